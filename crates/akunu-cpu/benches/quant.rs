//! Single-threaded throughput of the quant kernels (no bench framework).
//!
//!     cargo bench -p akunu-cpu --bench quant
//!     AKUNU_SIMD=avx2 cargo bench -p akunu-cpu --bench quant   # force a level
//!
//! GEMV reports GB/s of weight bytes streamed; GEMM reports GFLOP/s
//! (2 * rows * k * n_x). Each figure is the median of several timed
//! repeats, each repeat long enough (~20 ms) to swamp timer noise.

use akunu_core::dtype::DType;
use akunu_cpu::quant::{
    Q8Act, gemm, gemv, gemv_multi, gemv_q8, gemv_q8_multi, row_bytes, simd_level, supports_q8,
};
use std::hint::black_box;
use std::time::Instant;

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

/// Random, well-formed weights (finite scales) for `rows` x `k`.
fn weights(rng: &mut Rng, dtype: DType, rows: usize, k: usize) -> Vec<u8> {
    let n = rows * row_bytes(dtype, k);
    let mut w = Vec::with_capacity(n);
    match dtype {
        DType::F32 => (0..rows * k).for_each(|_| w.extend_from_slice(&rng.unit().to_le_bytes())),
        DType::F16 => (0..rows * k).for_each(|_| w.extend_from_slice(&f16_bytes(rng.unit()))),
        DType::BF16 => (0..rows * k).for_each(|_| {
            w.extend_from_slice(&((rng.unit().to_bits() >> 16) as u16).to_le_bytes())
        }),
        DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => {
            let nq = if dtype == DType::Q8_0 { 32 } else { 16 };
            for _ in 0..rows * k / 32 {
                w.extend_from_slice(&f16_bytes(rng.unit() * 0.1));
                if dtype == DType::Q4_1 {
                    w.extend_from_slice(&f16_bytes(rng.unit() * 0.1));
                }
                (0..nq).for_each(|_| w.push(rng.next() as u8));
            }
        }
        // The 5-bit and K-quant types: akunu's quantizer on random values.
        DType::Q5_0 | DType::Q5_1 | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
            let vals: Vec<f32> = (0..rows * k).map(|_| rng.unit() * 0.1).collect();
            w = akunu_core::quantize::quantize(dtype, &vals).expect("whole blocks");
        }
    }
    assert_eq!(w.len(), n);
    w
}

/// (median, best) seconds per call of `f`, over `reps` repeats of a batch
/// sized to last roughly `target` seconds. The best repeat is printed too:
/// on a shared machine it is the least disturbed estimate.
fn time_it(mut f: impl FnMut(), target: f64, reps: usize) -> (f64, f64) {
    // Warm up (page faults, caches) and size the batch.
    let t = Instant::now();
    f();
    let one = t.elapsed().as_secs_f64().max(1e-7);
    let iters = ((target / one) as usize).clamp(1, 1_000_000);
    let mut samples: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_secs_f64() / iters as f64
        })
        .collect();
    samples.sort_by(|a, b| a.total_cmp(b));
    (samples[reps / 2], samples[0])
}

fn main() {
    // `cargo bench` passes "--bench"; an extra free argument filters dtypes.
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    println!(
        "akunu quant kernels, simd level: {} (single thread)",
        simd_level()
    );
    let dtypes = [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::F16,
        DType::BF16,
        DType::F32,
    ];
    let shapes = [(576, 576), (1536, 576), (576, 1536), (49152, 576)];
    // K-quant rows must be whole 256-element super-blocks: 512 stands in
    // for 576 (the columns of the table below keep SmolLM2's row counts).
    let k_shape = |dtype: DType, (r, k): (usize, usize)| {
        if dtype.block_elems() == 256 && k % 256 != 0 {
            (r, 512)
        } else {
            (r, k)
        }
    };
    let mut rng = Rng(0xDEAD_BEEF_1234_5678);

    println!("\nGEMV (rows x k; K-quants: k = 512 for 576), GB/s of weight bytes, median (best):");
    print!("{:>6}", "dtype");
    for (r, k) in shapes {
        print!(" {:>15}", format!("{r}x{k}"));
    }
    println!();
    for dtype in dtypes {
        if filter
            .as_deref()
            .is_some_and(|f| !dtype.name().eq_ignore_ascii_case(f))
        {
            continue;
        }
        print!("{:>6}", dtype.name());
        for (rows, k) in shapes.map(|sh| k_shape(dtype, sh)) {
            let w = weights(&mut rng, dtype, rows, k);
            let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
            let mut y = vec![0f32; rows];
            let (med, best) = time_it(
                || gemv(dtype, black_box(&w), k, black_box(&x), black_box(&mut y)),
                0.02,
                9,
            );
            let gbs = |s: f64| w.len() as f64 / s / 1e9;
            print!(" {:>15}", format!("{:.2} ({:.2})", gbs(med), gbs(best)));
        }
        println!();
    }

    // Same shapes with 8-bit activations (integer dot products). Each call
    // includes quantizing x, as a decode step would; GB/s of weight bytes.
    println!("\nGEMV with q8 activations (quantize x + gemv_q8), GB/s, median (best):");
    for dtype in dtypes {
        if !supports_q8(dtype)
            || filter
                .as_deref()
                .is_some_and(|f| !dtype.name().eq_ignore_ascii_case(f))
        {
            continue;
        }
        print!("{:>9}", format!("{} x q8", dtype.name()));
        for (rows, k) in shapes {
            let w = weights(&mut rng, dtype, rows, k);
            let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
            let mut y = vec![0f32; rows];
            let mut xq = Q8Act::new();
            let (med, best) = time_it(
                || {
                    xq.quantize(black_box(&x));
                    gemv_q8(dtype, black_box(&w), k, &xq, black_box(&mut y))
                },
                0.02,
                9,
            );
            let gbs = |s: f64| w.len() as f64 / s / 1e9;
            print!(" {:>15}", format!("{:.2} ({:.2})", gbs(med), gbs(best)));
        }
        println!();
    }
    for k in [576, 1536] {
        let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
        let mut xq = Q8Act::new();
        let (med, _) = time_it(|| xq.quantize(black_box(&x)), 0.01, 5);
        println!("  quantize k={k}: {:.0} ns", med * 1e9);
    }

    // Exact multi-row products (speculative verification): time of one
    // call over n_x input rows relative to n_x one-row calls (< 1: the
    // shared weight unpacking pays off). Both activation modes.
    println!("\nGEMV multi-row (exact), cost of one n_x-row call / n_x one-row calls, median:");
    let multi_shapes = [(576, 576), (1536, 576), (576, 1536), (49152, 576)];
    let n_xs = [2, 4, 5, 8, 16];
    print!("{:>18}", "dtype shape");
    for n in n_xs {
        print!(" {:>7}", format!("n_x={n}"));
    }
    println!();
    for dtype in dtypes {
        if filter
            .as_deref()
            .is_some_and(|f| !dtype.name().eq_ignore_ascii_case(f))
        {
            continue;
        }
        for q8 in [false, true] {
            if q8 && !supports_q8(dtype) {
                continue;
            }
            for (rows, k) in multi_shapes.map(|sh| k_shape(dtype, sh)) {
                let w = weights(&mut rng, dtype, rows, k);
                let x: Vec<f32> = (0..16 * k).map(|_| rng.unit()).collect();
                let xq: Vec<Q8Act> = x
                    .chunks_exact(k)
                    .map(|xr| {
                        let mut q = Q8Act::new();
                        q.quantize(xr);
                        q
                    })
                    .collect();
                let mut y = vec![0f32; 16 * rows];
                let (one, _) = time_it(
                    || {
                        if q8 {
                            gemv_q8(dtype, black_box(&w), k, &xq[0], black_box(&mut y[..rows]))
                        } else {
                            gemv(
                                dtype,
                                black_box(&w),
                                k,
                                black_box(&x[..k]),
                                black_box(&mut y[..rows]),
                            )
                        }
                    },
                    0.02,
                    7,
                );
                let act = if q8 { "q8" } else { "f32" };
                print!("{:>18}", format!("{} {act} {rows}x{k}", dtype.name()));
                for n in n_xs {
                    let (t, _) = time_it(
                        || {
                            let yv = black_box(&mut y[..n * rows]);
                            if q8 {
                                gemv_q8_multi(dtype, black_box(&w), k, rows, &xq[..n], yv)
                            } else {
                                gemv_multi(
                                    dtype,
                                    black_box(&w),
                                    k,
                                    rows,
                                    black_box(&x[..n * k]),
                                    n,
                                    yv,
                                )
                            }
                        },
                        0.02,
                        7,
                    );
                    print!(" {:>7.2}", t / (n as f64 * one));
                }
                println!();
            }
        }
    }

    let n_x = 64;
    println!("\nGEMM 576x576 (K-quants: 576x512), n_x={n_x}, GFLOP/s, median (best):");
    for dtype in dtypes {
        if filter
            .as_deref()
            .is_some_and(|f| !dtype.name().eq_ignore_ascii_case(f))
        {
            continue;
        }
        let (rows, k) = k_shape(dtype, (576, 576));
        let w = weights(&mut rng, dtype, rows, k);
        let x: Vec<f32> = (0..k * n_x).map(|_| rng.unit()).collect();
        let mut y = vec![0f32; rows * n_x];
        let (med, best) = time_it(
            || {
                gemm(
                    dtype,
                    black_box(&w),
                    k,
                    rows,
                    black_box(&x),
                    n_x,
                    black_box(&mut y),
                )
            },
            0.05,
            7,
        );
        let gf = |s: f64| 2.0 * (rows * k * n_x) as f64 / s / 1e9;
        println!("{:>6} {:>8.1} ({:.1})", dtype.name(), gf(med), gf(best));
    }
}
