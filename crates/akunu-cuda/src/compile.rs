//! Run-time compilation of the embedded kernel sources with NVRTC, for the
//! exact architecture of the device, with a disk cache of the machine code.
//!
//! The cache key is a SHA-256 over the sources, the compile options, the
//! target architecture, the NVRTC version and the driver version, so a
//! changed kernel, toolkit or driver never loads stale code.

use akunu_core::ops::KvType;
use cudarc::nvrtc::sys as nv;
use sha2::{Digest, Sha256};
use std::ffi::{CStr, CString};
use std::path::PathBuf;

/// The kernel sources, in the order they are concatenated.
pub const SOURCES: [(&str, &str); 6] = [
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("noise.cuh", include_str!("../kernels/noise.cuh")),
    ("tc.cuh", include_str!("../kernels/tc.cuh")),
    ("model.cu", include_str!("../kernels/model.cu")),
    ("gemv_tc.cu", include_str!("../kernels/gemv_tc.cu")),
    ("sampling.cu", include_str!("../kernels/sampling.cu")),
];

/// The persistent decode kernel (`persist.rs`): its own module, compiled
/// per model shape.
pub const PERSIST_SOURCES: [(&str, &str); 4] = [
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("noise.cuh", include_str!("../kernels/noise.cuh")),
    (
        "chain_sampler.cuh",
        include_str!("../kernels/chain_sampler.cuh"),
    ),
    ("persist.cu", include_str!("../kernels/persist.cu")),
];

/// The streaming persistent decode kernel (`stream.rs`): its own module,
/// compiled per model shape. Developer switches reach it as they reach the
/// persistent module (`Module::Persistent`).
pub const STREAM_SOURCES: [(&str, &str); 5] = [
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("noise.cuh", include_str!("../kernels/noise.cuh")),
    ("tc.cuh", include_str!("../kernels/tc.cuh")),
    (
        "chain_sampler.cuh",
        include_str!("../kernels/chain_sampler.cuh"),
    ),
    ("stream.cu", include_str!("../kernels/stream.cu")),
];

/// One translation unit: the sources with `#line` markers, so compiler
/// messages name the original file and line.
fn unit(sources: &[(&str, &str)]) -> String {
    let mut s = String::new();
    for (name, text) in sources {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// The main module's translation unit.
pub fn full_source() -> String {
    unit(&SOURCES)
}

/// The persistent decode module's translation unit.
pub fn persist_source() -> String {
    unit(&PERSIST_SOURCES)
}

/// The streaming decode module's translation unit.
pub fn stream_source() -> String {
    unit(&STREAM_SOURCES)
}

/// Which module a compile is for: the developer switches named `PD_*`
/// (`AKUNU_CUDA_DEFINES`) reach the persistent decode module alone.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Module {
    Main,
    Persistent,
}

fn options(arch: &str, module: Module) -> Vec<String> {
    let mut o = vec![
        format!("-arch={arch}"),
        "-default-device".into(),
        "-std=c++17".into(),
        "-lineinfo".into(),
    ];
    o.extend(defines_for(
        std::env::var("AKUNU_CUDA_DEFINES").as_deref().unwrap_or(""),
        module,
    ));
    o
}

/// Whether the developer switch `AKUNU_CUDA_DEFINES` defines `name` (so that
/// a default the backend would pass for it stays out of the way).
pub fn developer_defines_name(name: &str) -> bool {
    defines_name(
        std::env::var("AKUNU_CUDA_DEFINES").as_deref().unwrap_or(""),
        name,
    )
}

fn defines_name(words: &str, name: &str) -> bool {
    defines_for(words, Module::Persistent)
        .iter()
        .any(|w| w[2..].split('=').next() == Some(name))
}

/// Developer switch: `AKUNU_CUDA_DEFINES="-DSMB_TIMING ..."` adds macro
/// definitions to the compile (kernel experiments and in-kernel timers
/// without a rebuild). Words other than `-DNAME[=VALUE]` are ignored. They
/// are compile options, so they are part of the cache key. Those named
/// `PD_*` are persist.cu's and go to that module only, so that an
/// experiment on the persistent kernel does not recompile (and re-cache)
/// the main module. `KV_F16` is ignored: the cache's type is the
/// backend's (`--kv-type`), which sizes the buffers by it.
fn defines_for(words: &str, module: Module) -> Vec<String> {
    words
        .split_whitespace()
        .filter(|w| w.starts_with("-D") && w.len() > 2)
        .filter(|w| w[2..].split('=').next() != Some("KV_F16"))
        .filter(|w| module == Module::Persistent || !w.starts_with("-DPD_"))
        .map(str::to_string)
        .collect()
}

fn nvrtc_version() -> Result<(i32, i32), String> {
    let (mut maj, mut min) = (0, 0);
    // SAFETY: plain out-parameters; the library was found by the caller.
    let r = unsafe { nv::nvrtcVersion(&mut maj, &mut min) };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion failed: {r:?}"));
    }
    Ok((maj, min))
}

fn cache_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("AKUNU_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    akunu_core::fetch::cache_dir().ok().map(|d| d.join("cuda"))
}

/// The define that picks the KV cache's element type (common.cuh `kv_t`).
pub fn kv_define(kv: KvType) -> String {
    format!("-DKV_F16={}", (kv == KvType::F16) as u32)
}

/// Machine code (a cubin) of the main module for `arch` ("sm_90") with a
/// KV cache of `kv`, from the disk cache or freshly compiled. `say`
/// receives one line when compiling.
pub fn cubin(
    arch: &str,
    driver: i32,
    kv: KvType,
    say: &mut dyn FnMut(&str),
) -> Result<Vec<u8>, String> {
    cubin_of(
        &full_source(),
        Module::Main,
        &[kv_define(kv)],
        "CUDA kernels",
        arch,
        driver,
        say,
    )
}

/// Machine code of `src` compiled with `extra` options besides the usual
/// ones, cached as `cubin` caches the main module's.
pub fn cubin_of(
    src: &str,
    module: Module,
    extra: &[String],
    what: &str,
    arch: &str,
    driver: i32,
    say: &mut dyn FnMut(&str),
) -> Result<Vec<u8>, String> {
    // SAFETY: probing for the shared library has no preconditions.
    if !unsafe { nv::is_culib_present() } {
        return Err(
            "NVRTC (libnvrtc.so) was not found: install the CUDA toolkit's \
                    runtime compiler or add its lib64 directory to LD_LIBRARY_PATH"
                .into(),
        );
    }
    let (maj, min) = nvrtc_version()?;
    let mut opts = options(arch, module);
    opts.extend(extra.iter().cloned());
    let mut h = Sha256::new();
    h.update(src.as_bytes());
    for o in &opts {
        h.update(o.as_bytes());
    }
    h.update(format!("nvrtc {maj}.{min} driver {driver}").as_bytes());
    let key: String = h
        .finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect();
    let path = cache_dir().map(|d| d.join(format!("akunu-{arch}-{key}.cubin")));
    if let Some(p) = &path
        && let Ok(bytes) = std::fs::read(p)
        && !bytes.is_empty()
    {
        return Ok(bytes);
    }
    say(&format!(
        "compiling {what} for {arch} (NVRTC {maj}.{min})..."
    ));
    let bin = compile(src, &opts)?;
    if let Some(p) = &path {
        // A cache that cannot be written costs a compile next time, not an
        // error: write to a temporary name, then rename, so a concurrent
        // reader never sees half a file.
        if let Some(dir) = p.parent()
            && std::fs::create_dir_all(dir).is_ok()
        {
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &bin).is_ok() {
                let _ = std::fs::rename(&tmp, p);
            }
        }
    }
    Ok(bin)
}

/// Compiles `src` to a cubin; the error carries the compiler's log.
pub fn compile(src: &str, opts: &[String]) -> Result<Vec<u8>, String> {
    let csrc = CString::new(src).map_err(|_| "kernel source contains a NUL byte".to_string())?;
    let name = CString::new("akunu.cu").expect("no NUL");
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).expect("options have no NUL"))
        .collect();
    let optr: Vec<*const std::ffi::c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    let check = |r: nv::nvrtcResult, what: &str| {
        if r == nv::nvrtcResult::NVRTC_SUCCESS {
            Ok(())
        } else {
            Err(format!("{what} failed: {r:?}"))
        }
    };
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer passed is valid for the duration of its call
    // (the CStrings above outlive the program); the program is destroyed
    // on every path below.
    unsafe {
        check(
            nv::nvrtcCreateProgram(
                &mut prog,
                csrc.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ),
            "nvrtcCreateProgram",
        )?;
        let compiled = nv::nvrtcCompileProgram(prog, optr.len() as i32, optr.as_ptr());
        let mut log_len = 0usize;
        nv::nvrtcGetProgramLogSize(prog, &mut log_len);
        let mut log = vec![0u8; log_len.max(1)];
        nv::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut std::ffi::c_char);
        let log = CStr::from_bytes_until_nul(&log)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();
        let result = if compiled != nv::nvrtcResult::NVRTC_SUCCESS {
            Err(format!("CUDA kernel compilation failed:\n{log}"))
        } else {
            let mut n = 0usize;
            check(nv::nvrtcGetCUBINSize(prog, &mut n), "nvrtcGetCUBINSize").and_then(|_| {
                let mut bin = vec![0u8; n];
                check(
                    nv::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut std::ffi::c_char),
                    "nvrtcGetCUBIN",
                )
                .map(|_| bin)
            })
        };
        nv::nvrtcDestroyProgram(&mut prog);
        result
    }
}

#[cfg(test)]
mod tests {
    /// With `AKUNU_CUBIN_DIR` set, the compile test writes each module's
    /// cubin there under `name` (for `tools/sass_sites.py`; experiments
    /// pass their switches in `AKUNU_CUDA_DEFINES`).
    fn keep_cubin(name: &str, bin: &[u8]) {
        if let Ok(dir) = std::env::var("AKUNU_CUBIN_DIR") {
            std::fs::create_dir_all(&dir).expect("AKUNU_CUBIN_DIR can be created");
            std::fs::write(
                std::path::Path::new(&dir).join(format!("{name}.cubin")),
                bin,
            )
            .expect("AKUNU_CUBIN_DIR is writable");
        }
    }

    /// Compiles the embedded kernels when NVRTC is installed (no GPU
    /// needed); `AKUNU_REQUIRE_NVRTC=1` makes a missing NVRTC a failure.
    #[test]
    fn kernels_compile_with_nvrtc() {
        // SAFETY: probing for the shared library has no preconditions.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            assert!(
                std::env::var("AKUNU_REQUIRE_NVRTC").is_err(),
                "AKUNU_REQUIRE_NVRTC is set but libnvrtc was not found"
            );
            eprintln!("NVRTC not installed: kernel compilation not checked");
            return;
        }
        // The main module with each KV cache type.
        for kv in [super::KvType::F16, super::KvType::F32] {
            let mut opts = super::options("sm_90", super::Module::Main);
            opts.push(super::kv_define(kv));
            let bin =
                super::compile(&super::full_source(), &opts).unwrap_or_else(|e| panic!("{e}"));
            assert!(bin.len() > 1000);
        }
        // The persistent decode module, generic and at SmolLM2's shape.
        let mut opts = super::options("sm_90", super::Module::Persistent);
        let bin = super::compile(&super::persist_source(), &opts).unwrap_or_else(|e| panic!("{e}"));
        assert!(bin.len() > 1000);
        opts.extend(crate::persist::shape_defines(576, 576, 192, 1536, 9, 3));
        let bin = super::compile(&super::persist_source(), &opts).unwrap_or_else(|e| panic!("{e}"));
        assert!(bin.len() > 1000);
        // Its bulk-copy form (sm_90's), with each KV cache type, with the
        // sampler (a sampled table's module, its part and pick called as
        // persist.rs compiles them) and without (a greedy one's), with the
        // embedding's and logits' forms as persist.rs passes them (Q4_1, or
        // Q8_0; the modules above read them from the arguments).
        opts.push("-DPD_BULK=1".into());
        let q4_1 = ["-DPD_EMB_Q8=0", "-DPD_OUT_Q8=0"];
        for kv in [super::KvType::F16, super::KvType::F32] {
            for module in [
                &[
                    "-DPD_GREEDY_ONLY=0",
                    "-DPD_SAMP_NOINLINE=1",
                    q4_1[0],
                    q4_1[1],
                ][..],
                &["-DPD_GREEDY_ONLY=1", q4_1[0], q4_1[1]],
                &["-DPD_GREEDY_ONLY=1", "-DPD_EMB_Q8=1", "-DPD_OUT_Q8=1"],
            ] {
                let mut o = opts.clone();
                o.push(super::kv_define(kv));
                o.extend(module.iter().map(|d| d.to_string()));
                let bin =
                    super::compile(&super::persist_source(), &o).unwrap_or_else(|e| panic!("{e}"));
                assert!(bin.len() > 1000);
                let form = if module.contains(&"-DPD_EMB_Q8=1") {
                    "q8_0"
                } else {
                    "q4_1"
                };
                let mode = if module[0].ends_with("=0") {
                    "sampled"
                } else {
                    "greedy"
                };
                keep_cubin(&format!("persist-smollm2-{form}-{mode}-kv{kv:?}"), &bin);
            }
        }
        // The streaming decode module at the 1B and 8B shapes, F16
        // and Q4_0 (the stages and splits a 132-SM device gets): greedy with
        // each KV cache type, and a sampled table's module (the in-kernel
        // sampler); Q4_0 with llama.cpp's Q6_K logits (8B: the output
        // matrix; 1B: tied, the embedding too), greedy and sampled. Q4_0
        // takes its stage images (SD_STAGED) as plans give them where the
        // device has room; the 8B shape also without them (the fallback).
        let q6_out: &[&str] = &["-DSD_OUT_Q6=1"];
        let q6_tied: &[&str] = &["-DSD_OUT_Q6=1", "-DSD_EMB_Q6=1"];
        for (d, kvd, ff, nst, q4, staged, q6) in [
            (2048, 512, 8192, 5, false, false, &[][..]),
            (4096, 1024, 14336, 4, false, false, &[]),
            (2048, 512, 8192, 5, true, true, &[]),
            (4096, 1024, 14336, 4, true, true, &[]),
            (4096, 1024, 14336, 4, true, false, &[]),
            (2048, 512, 8192, 5, true, true, q6_tied),
            (4096, 1024, 14336, 4, true, true, q6_out),
        ] {
            let geo = crate::stream::shape_fits(d, d, kvd, ff, 32, 49152, 132, q4).unwrap();
            let mut geo = geo;
            geo.staged = staged;
            let kinds: &[_] = if q6.is_empty() {
                &[
                    (super::KvType::F16, false),
                    (super::KvType::F32, false),
                    (super::KvType::F16, true),
                ]
            } else {
                &[(super::KvType::F16, false), (super::KvType::F16, true)]
            };
            for &(kv, sampled) in kinds {
                let mut o = super::options("sm_90", super::Module::Persistent);
                let att_s = crate::stream::att_splits(132, 32);
                let att = crate::stream::att_floats(128, geo.cw, 4096, att_s);
                let lay = crate::stream::layout(d, d, kvd, ff, 49152, 132, geo.cw, att);
                o.extend(crate::stream::defines(
                    d, d, kvd, ff, 32, 8, lay, nst, att_s, geo,
                ));
                o.push(super::kv_define(kv));
                if sampled {
                    o.push("-DSD_SAMPLED=1".into());
                }
                o.extend(q6.iter().map(|s| s.to_string()));
                let bin =
                    super::compile(&super::stream_source(), &o).unwrap_or_else(|e| panic!("{e}"));
                assert!(bin.len() > 1000);
                keep_cubin(
                    &format!(
                        "stream-d{d}-{}{}-{}-kv{kv:?}",
                        if q4 { "q4_0" } else { "f16" },
                        if !q6.is_empty() {
                            "-q6k"
                        } else if q4 && !staged {
                            "-boxes"
                        } else {
                            ""
                        },
                        if sampled { "sampled" } else { "greedy" },
                    ),
                    &bin,
                );
            }
        }
    }

    #[test]
    fn persistent_switches_reach_only_their_module() {
        use super::{Module, defines_for};
        let w = "-DSMB_TIMING -DPD_BULK=1 junk -D -DPD_TIMING -DKV_F16=0";
        assert_eq!(defines_for(w, Module::Main), ["-DSMB_TIMING"]);
        assert_eq!(
            defines_for(w, Module::Persistent),
            ["-DSMB_TIMING", "-DPD_BULK=1", "-DPD_TIMING"]
        );
        assert!(super::defines_name(w, "PD_BULK"));
        assert!(super::defines_name(w, "PD_TIMING"));
        assert!(!super::defines_name(w, "PD_BUL"));
        assert!(!super::defines_name("-DPD_BULKY=1", "PD_BULK"));
    }
}
