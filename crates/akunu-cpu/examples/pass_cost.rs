//! The cost of a verification pass's products against a one-row step, at
//! the default model's shapes (SmolLM2-135M: 30 layers of Q4_1 576-wide
//! products, a Q8_0 49152 x 576 output matrix), one thread, random weights
//! laid out like the model (every layer its own matrices, so the weights
//! stream from memory as in decode):
//!
//!     cargo run --release -p akunu-cpu --example pass_cost -- [reps] [rows...]
//!
//! Prints, per row count n, the time of the multi-row products (256-row
//! tiles, as `kernels::gemv` calls them) over the one-row step's, split into
//! the body and the output matrix, and the cost of an extra row in one-row
//! steps. Each figure is the mean over `reps` (default 20) of the thread's
//! CPU time where Linux reports it (`/proc/thread-self/schedstat`: time
//! spent waiting for a core on a shared machine is left out; the kernel may
//! account it in scheduler ticks, hence a mean over many repeats rather
//! than a minimum), else the best wall time.

use akunu_core::dtype::DType;
use akunu_cpu::quant::{gemv, gemv_multi, row_bytes, simd_level};
use std::hint::black_box;
use std::time::Instant;

/// Nanoseconds this thread has run (Linux), else wall-clock nanoseconds.
fn now_ns(t0: Instant) -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| t0.elapsed().as_nanos() as u64)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

fn weights(rng: &mut Rng, dtype: DType, rows: usize, k: usize) -> Vec<u8> {
    let mut w = Vec::with_capacity(rows * row_bytes(dtype, k));
    let nq = if dtype == DType::Q8_0 { 32 } else { 16 };
    for _ in 0..rows * k / 32 {
        w.extend_from_slice(&f16_bytes(rng.unit() * 0.1));
        if dtype == DType::Q4_1 {
            w.extend_from_slice(&f16_bytes(rng.unit() * 0.1));
        }
        (0..nq).for_each(|_| w.push(rng.next() as u8));
    }
    w
}

struct Mat {
    dtype: DType,
    rows: usize,
    k: usize,
    w: Vec<u8>,
}

fn run(m: &Mat, x: &[f32], n: usize, y: &mut [f32]) {
    let rb = row_bytes(m.dtype, m.k);
    if n == 1 {
        gemv(m.dtype, black_box(&m.w), m.k, &x[..m.k], &mut y[..m.rows]);
        return;
    }
    const TILE: usize = 256;
    let mut i0 = 0;
    while i0 < m.rows {
        let tn = TILE.min(m.rows - i0);
        let wt = &m.w[i0 * rb..(i0 + tn) * rb];
        gemv_multi(m.dtype, wt, m.k, tn, &x[..n * m.k], n, &mut y[..tn * n]);
        i0 += tn;
    }
    black_box(&y);
}

/// `micro DTYPE ROWS K N...`: one tile of ROWS weight rows (L2-resident),
/// CPU ns per (weight row, input row, 32-element block) of gemv_multi.
fn micro(args: &[String]) {
    let dtype = match args[0].as_str() {
        "q8_0" => DType::Q8_0,
        _ => DType::Q4_1,
    };
    let (rows, k): (usize, usize) = (args[1].parse().unwrap(), args[2].parse().unwrap());
    let mut rng = Rng(7);
    let w = weights(&mut rng, dtype, rows, k);
    let x: Vec<f32> = (0..16 * k).map(|_| rng.unit()).collect();
    let mut y = vec![0f32; rows * 16];
    let m = Mat { dtype, rows, k, w };
    let t0 = Instant::now();
    for n in args[3..].iter().map(|s| s.parse::<usize>().unwrap()) {
        let iters = (2e8 as usize / (rows * k * n)).max(1);
        run(&m, &x, n, &mut y);
        let t = now_ns(t0);
        for _ in 0..iters {
            run(&m, &x, n, &mut y);
        }
        let ns = (now_ns(t0) - t) as f64 / (iters * rows * n * k / 32) as f64;
        println!(
            "{} {rows}x{k} n={n:>2}: {ns:.3} ns per (row, input, block)",
            args[0]
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "micro") {
        return micro(&args[1..]);
    }
    let reps: usize = args.first().map(|s| s.parse().unwrap()).unwrap_or(20);
    let ns: Vec<usize> = if args.len() > 1 {
        args[1..].iter().map(|s| s.parse().unwrap()).collect()
    } else {
        vec![1, 2, 4, 8, 12, 16]
    };
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    let mut body = Vec::new();
    for _ in 0..30 {
        for (rows, k) in [(960, 576), (576, 576), (3072, 576), (576, 1536)] {
            body.push(Mat {
                dtype: DType::Q4_1,
                rows,
                k,
                w: weights(&mut rng, DType::Q4_1, rows, k),
            });
        }
    }
    let out = Mat {
        dtype: DType::Q8_0,
        rows: 49152,
        k: 576,
        w: weights(&mut rng, DType::Q8_0, 49152, 576),
    };
    let x: Vec<f32> = (0..16 * 1536).map(|_| rng.unit()).collect();
    let mut y = vec![0f32; 49152 * 16];
    let cpu_time = std::fs::read_to_string("/proc/thread-self/schedstat").is_ok();
    println!(
        "pass_cost: {} (one thread), {}",
        simd_level(),
        if cpu_time {
            format!("mean CPU time of {reps}")
        } else {
            format!("best wall time of {reps}")
        }
    );
    let mut base = (0.0, 0.0);
    let t0 = Instant::now();
    for &n in &ns {
        let (mut tb, mut to) = if cpu_time {
            (0.0, 0.0)
        } else {
            (f64::MAX, f64::MAX)
        };
        for _ in 0..reps {
            let t = now_ns(t0);
            for m in &body {
                run(m, &x, n, &mut y);
            }
            let u = now_ns(t0);
            run(&out, &x, n, &mut y);
            let (b, o) = ((u - t) as f64 * 1e-9, (now_ns(t0) - u) as f64 * 1e-9);
            if cpu_time {
                tb += b / reps as f64;
                to += o / reps as f64;
            } else {
                tb = tb.min(b);
                to = to.min(o);
            }
        }
        if n == 1 {
            base = (tb, to);
        }
        let step = base.0 + base.1;
        println!(
            "n={n:>2}: body {:>7.2} ms ({:.3} per row of one-row), output {:>6.2} ms ({:.3}), \
             pass {:.2} steps, extra row {:.3} steps",
            tb * 1e3,
            tb / base.0 / n as f64,
            to * 1e3,
            to / base.1 / n as f64,
            (tb + to) / step,
            if n > 1 {
                ((tb + to) / step - 1.0) / (n - 1) as f64
            } else {
                0.0
            }
        );
    }
}
