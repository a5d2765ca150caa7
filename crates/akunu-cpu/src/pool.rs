//! A small persistent thread pool for the replay loop.
//!
//! A decode step runs ~200 commands, each split across all cores, hundreds
//! of times a second: a fork-join that costs tens of microseconds (thread
//! wake-ups through the OS) would eat a large share of the step. Workers
//! therefore spin on an epoch counter for a while after each job and only
//! then park, so back-to-back commands reach them in well under a
//! microsecond, while an idle engine sleeps instead of burning cores.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    /// Incremented once per job; workers run a job when they see it change.
    epoch: AtomicU64,
    /// The current job. Written by the caller before the epoch bump
    /// (release) and read by workers after observing it (acquire).
    job: UnsafeCell<Option<*const Job>>,
    /// Workers still running the current job.
    remaining: AtomicUsize,
    stop: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is only written by the thread that owns the pool while no
// job is in flight (all workers have finished, `remaining == 0`), and only
// read by workers between the epoch bump and their decrement of
// `remaining`; the atomics order these accesses (release/acquire).
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
}

/// How long a worker spins for the next job before parking.
const SPIN: Duration = Duration::from_millis(3);
/// Busy-wait iterations before waiting threads start yielding their core.
const YIELD_AFTER: u32 = 4096;

impl ThreadPool {
    /// A pool running jobs on `n_threads` threads: the caller plus
    /// `n_threads - 1` workers.
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            remaining: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..n_threads)
            .map(|tid| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("akunu-cpu-{tid}"))
                    .spawn(move || worker(s, tid, n_threads))
                    .expect("spawning a worker thread")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            n_threads,
        }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(thread_index, n_threads)` on every thread of the pool and
    /// returns when all have finished.
    pub fn run(&self, f: &(dyn Fn(usize, usize) + Sync)) {
        if self.n_threads == 1 {
            f(0, 1);
            return;
        }
        let s = &*self.shared;
        // SAFETY: no job is in flight (the previous `run` waited for
        // `remaining == 0`), so no worker reads `job` now. The pointer is
        // only dereferenced before this function returns, while `f` lives.
        // The transmute erases the borrow's lifetime for storage only.
        unsafe {
            let p: *const Job =
                std::mem::transmute::<&(dyn Fn(usize, usize) + Sync), &'static Job>(f);
            *s.job.get() = Some(p);
        }
        s.remaining.store(self.n_threads - 1, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::Release);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        f(0, self.n_threads);
        let mut spins = 0u32;
        while s.remaining.load(Ordering::Acquire) != 0 {
            spins += 1;
            // On an oversubscribed machine the worker we wait for may not
            // be running: give it our core instead of spinning it away.
            if spins > YIELD_AFTER {
                std::thread::yield_now()
            } else {
                std::hint::spin_loop()
            }
        }
    }
}

fn worker(s: Arc<Shared>, tid: usize, n: usize) {
    let mut seen = 0u64;
    loop {
        // Wait for a new epoch: spin first, then park.
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins += 1;
            if spins.is_multiple_of(1024) && start.elapsed() > SPIN {
                let g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                if s.epoch.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                    let _g = s
                        .wake
                        .wait_timeout(g, Duration::from_millis(100))
                        .unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                spins = 0;
            } else if spins > YIELD_AFTER {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // SAFETY: the epoch was bumped after `job` was stored (release /
        // acquire), and the owner keeps the closure alive until every
        // worker has decremented `remaining` below.
        let job = unsafe { (*s.job.get()).expect("a job is set before the epoch moves") };
        unsafe { (*job)(tid, n) };
        s.remaining.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Splits `0..n` into `parts` contiguous ranges, each a multiple of `align`
/// long (except the last), and returns part `i`.
pub fn split_range(n: usize, parts: usize, i: usize, align: usize) -> std::ops::Range<usize> {
    let units = n.div_ceil(align);
    let per = units / parts;
    let extra = units % parts;
    let start_u = i * per + i.min(extra);
    let len_u = per + usize::from(i < extra);
    let start = (start_u * align).min(n);
    let end = ((start_u + len_u) * align).min(n);
    start..end
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_thread_runs_every_job() {
        let pool = ThreadPool::new(3);
        let total = AtomicU64::new(0);
        for _ in 0..1000 {
            pool.run(&|tid, n| {
                assert!(tid < n && n == 3);
                total.fetch_add(1 + tid as u64, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 1000 * 6);
    }

    #[test]
    fn split_covers_exactly() {
        for n in [0, 1, 7, 64, 1000, 1537] {
            for parts in 1..5 {
                for align in [1, 4, 16] {
                    let mut next = 0;
                    for i in 0..parts {
                        let r = split_range(n, parts, i, align);
                        assert_eq!(r.start, next);
                        next = r.end;
                    }
                    assert_eq!(next, n);
                }
            }
        }
    }
}
