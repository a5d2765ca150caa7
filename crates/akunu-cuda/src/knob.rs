//! Developer switches for A/B runs (`AKUNU_CUDA_*`, docs/ARCHITECTURE.md
//! "Developer switches"): an environment variable read once per process,
//! so a switch costs nothing on the paths that consult it while planning
//! launches.

use std::sync::OnceLock;

pub struct Knob {
    name: &'static str,
    value: OnceLock<Option<String>>,
}

impl Knob {
    pub const fn new(name: &'static str) -> Knob {
        Knob {
            name,
            value: OnceLock::new(),
        }
    }

    fn get(&self) -> Option<&str> {
        self.value
            .get_or_init(|| std::env::var(self.name).ok())
            .as_deref()
    }

    /// Whether the variable is set to exactly `v`.
    pub fn is(&self, v: &str) -> bool {
        self.get() == Some(v)
    }

    /// The variable as a number, when it is set and parses.
    pub fn number<T: std::str::FromStr>(&self) -> Option<T> {
        self.get().and_then(|v| v.trim().parse().ok())
    }
}
