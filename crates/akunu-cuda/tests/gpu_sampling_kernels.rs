//! The standalone sampling commands (repetition penalty, temperature,
//! grammar bitmask, top-k select, argmax, Gumbel sample) through the CUDA
//! backend, with the same test bodies and references as the CPU backend's.
//! They need an NVIDIA GPU: `scripts/gpu.sh` runs them with `--ignored`.

use akunu_core::backend::Backend;

fn backend(_threads: usize) -> Box<dyn Backend> {
    Box::new(akunu_cuda::CudaBackend::new(0, &mut |m| eprintln!("{m}")).expect("CUDA backend"))
}

mod body {
    use super::backend;
    include!("../../akunu-cpu/tests/shared/sampling_kernels_body.rs");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn repetition_penalty_and_temperature_commands() {
    body::repetition_penalty_and_temperature_commands()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn bitmask_topk_and_argmax_commands() {
    body::bitmask_topk_and_argmax_commands()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
fn gumbel_command_matches_the_library_transform_and_reads_the_chain() {
    body::gumbel_command_matches_the_library_transform_and_reads_the_chain()
}

/// The multi-block sampler (`k_sample_prep` + `k_sample_select`) against the
/// single-block `k_gumbel_sample`, bit for bit, on inputs that stress the
/// merge: ties across blocks, top-k above a block's share, candidates in
/// one block, vocabularies that are not a multiple of the slice, min-p /
/// top-p edges, masked and non-finite logits, penalty windows that cross
/// block boundaries. The argmax after it must pick the same token.
mod multi_block {
    use akunu_core::backend::{Backend, BufferRead};
    use akunu_core::ops::*;
    use akunu_core::sampling::{self, SamplingConfig, Scratch};
    use akunu_core::table::{CmdBuilder, DispatchTable, PatchType, StepInfo};
    use akunu_cuda::CudaBackend;
    use std::mem::offset_of;

    fn cuda(multi: bool) -> CudaBackend {
        let mut b = CudaBackend::new(0, &mut |m| eprintln!("{m}")).expect("CUDA backend");
        b.set_multi_block_sampling(multi);
        b
    }

    fn params(t: f32, k: u32, tp: f32, mp: f32, pen: f32, last_n: u32, n: u32) -> SampleParams {
        SampleParams {
            kv_len: 0,
            n_vocab: n,
            temperature: t,
            top_k: k,
            top_p: tp,
            min_p: mp,
            repeat_penalty: pen,
            repeat_last_n: last_n,
            seed_lo: 0x1234_5678,
            seed_hi: 9,
            recent_capacity: 2048,
            _pad: 0,
        }
    }

    /// Runs `GumbelSample` then `Argmax` once at `kv_len` with `recent` as
    /// the whole penalty history; returns the transformed logits and the
    /// token.
    fn sample(
        be: &mut CudaBackend,
        logits: &[f32],
        recent: &[u32],
        p: &SampleParams,
        kv_len: u32,
    ) -> (Vec<f32>, u32) {
        let n = logits.len();
        let lb = be.alloc((n * 4) as u64, "logits").unwrap();
        let rb = be.alloc(8 + 2048 * 4, "recent").unwrap();
        let cb = be.alloc(4 * 4, "conveyor").unwrap();
        let lbytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
        be.write(lb, 0, &lbytes).unwrap();
        // chain_start = kv_len: the window is `recent` alone.
        let mut r = bytemuck::bytes_of(&RecentHeader {
            chain_start: kv_len,
            n: recent.len() as u32,
        })
        .to_vec();
        r.extend(recent.iter().flat_map(|t| t.to_le_bytes()));
        be.write(rb, 0, &r).unwrap();
        be.write(cb, 0, &[0u8; 16]).unwrap();
        let mut t = DispatchTable {
            max_rows: 1,
            ..Default::default()
        };
        CmdBuilder::new(&mut t, KernelId::GumbelSample, 1)
            .buf(lb, 0)
            .buf(rb, 0)
            .buf(cb, 0)
            .params(p)
            .patch(PatchType::KvSeqLen, offset_of!(SampleParams, kv_len), 0)
            .emit();
        CmdBuilder::new(&mut t, KernelId::Argmax, 1)
            .buf(lb, 0)
            .buf(cb, 0)
            .params(&ArgmaxParams {
                n: n as u32,
                _pad: [0; 3],
            })
            .patch(PatchType::ArgmaxOutput, 0, 0)
            .emit();
        be.validate(&t).unwrap();
        be.replay(
            &t,
            StepInfo {
                pos: kv_len - 1,
                tok: 0,
                rows: 1,
            },
            1,
            None,
        )
        .unwrap();
        let out = be.read_f32s(lb, 0, n).unwrap();
        let tok = be.read_u32(cb, 1).unwrap();
        (out, tok)
    }

    fn u(seed: u64, i: u32) -> f32 {
        sampling::uniform(seed, i, 7)
    }

    fn random(n: u32, seed: u64) -> Vec<f32> {
        (0..n).map(|i| (u(seed, i) - 0.5) * 20.0).collect()
    }

    /// Eight distinct values: every tie class spans every block.
    fn quantised(n: u32, seed: u64) -> Vec<f32> {
        (0..n).map(|i| (u(seed, i) * 8.0).floor()).collect()
    }

    /// Low everywhere, high in `len` tokens from `start`.
    fn concentrated(n: u32, start: u32, len: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let base = (u(5, i) - 0.5) * 4.0 - 10.0;
                if (start..start + len).contains(&i) {
                    base + 20.0
                } else {
                    base
                }
            })
            .collect()
    }

    /// Grammar-like: only every 7th token allowed, a few NaN.
    fn masked(n: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                if i % 1009 == 3 {
                    f32::NAN
                } else if i % 7 != 0 {
                    f32::NEG_INFINITY
                } else {
                    (u(8, i) - 0.5) * 10.0
                }
            })
            .collect()
    }

    /// Ids in several blocks, duplicates, and ids beyond the vocabulary.
    fn window(n: u32) -> Vec<u32> {
        let mut w: Vec<u32> = (0..60).map(|j| (j * 997 + 11) % n).collect();
        w.extend([5, 5, n - 1, n, n + 7, 1023, 1024, 1025]);
        w
    }

    /// Single vs multi block (twice: the ticket must be reset), bits and
    /// token; with `library`, the kept set against the CPU transform too
    /// (pure top-k configurations: the kept set is a pure rank cut).
    struct Pair {
        single: CudaBackend,
        multi: CudaBackend,
    }

    fn pair() -> Pair {
        Pair {
            single: cuda(false),
            multi: cuda(true),
        }
    }

    fn check(
        be: &mut Pair,
        name: &str,
        logits: &[f32],
        recent: &[u32],
        p: &SampleParams,
        library: bool,
    ) {
        let kv_len = 777;
        let (want, want_tok) = sample(&mut be.single, logits, recent, p, kv_len);
        for round in 0..2 {
            let (got, tok) = sample(&mut be.multi, logits, recent, p, kv_len);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{name}, round {round}: token {i}: multi-block {g} vs single-block {w}"
                );
            }
            assert_eq!(tok, want_tok, "{name}, round {round}: sampled token");
        }
        if library {
            let cfg = SamplingConfig {
                temperature: p.temperature,
                top_k: p.top_k,
                top_p: p.top_p,
                min_p: p.min_p,
                repeat_penalty: p.repeat_penalty,
                repeat_last_n: p.repeat_last_n,
                seed: ((p.seed_hi as u64) << 32) | p.seed_lo as u64,
            };
            let mut lib = logits.to_vec();
            sampling::gumbel_transform(&mut lib, recent, &cfg, kv_len, &mut Scratch::new());
            let kept =
                |v: &[f32]| -> Vec<usize> { (0..v.len()).filter(|&i| v[i].is_finite()).collect() };
            assert_eq!(
                kept(&want),
                kept(&lib),
                "{name}: kept set vs the CPU transform"
            );
        }
    }

    const V: u32 = 49_152;

    #[test]
    #[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
    fn multi_block_default_configuration() {
        let mut be = pair();
        for (seed, n) in [(1, V), (2, 50_003), (3, 151_936), (4, 1_500), (5, 300)] {
            let l = random(n, seed);
            let w = window(n);
            let name = format!("default config, n {n}");
            check(
                &mut be,
                &name,
                &l,
                &w,
                &params(0.8, 40, 0.95, 0.0, 1.1, 64, n),
                false,
            );
            check(
                &mut be,
                &name,
                &l,
                &w,
                &params(0.8, 40, 1.0, 0.0, 1.0, 64, n),
                true,
            );
            check(
                &mut be,
                &name,
                &l,
                &w,
                &params(1.0, 1, 1.0, 0.0, 1.1, 64, n),
                true,
            );
            check(
                &mut be,
                &name,
                &l,
                &w,
                &params(1.2, 50, 0.95, 0.05, 1.1, 64, n),
                false,
            );
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
    fn multi_block_ties_across_blocks() {
        let mut be = pair();
        let w = window(V);
        let q = quantised(V, 3);
        check(
            &mut be,
            "quantised",
            &q,
            &w,
            &params(0.8, 40, 0.95, 0.0, 1.0, 64, V),
            false,
        );
        check(
            &mut be,
            "quantised",
            &q,
            &w,
            &params(0.8, 40, 1.0, 0.0, 1.0, 64, V),
            true,
        );
        check(
            &mut be,
            "quantised",
            &q,
            &w,
            &params(0.8, 256, 0.5, 0.0, 1.0, 64, V),
            false,
        );
        let flat = vec![1.5f32; V as usize];
        check(
            &mut be,
            "all equal",
            &flat,
            &[],
            &params(0.8, 40, 0.95, 0.0, 1.0, 64, V),
            false,
        );
        check(
            &mut be,
            "all equal",
            &flat,
            &[],
            &params(0.8, 300, 0.001, 0.0, 1.0, 64, V),
            false,
        );
        check(
            &mut be,
            "all equal, top-k",
            &flat,
            &[],
            &params(0.8, 40, 1.0, 0.0, 1.0, 64, V),
            true,
        );
        // Signed zeros at the top: -0 (lower id) and +0.
        let mut z = random(V, 6);
        z.iter_mut().for_each(|x| *x = -x.abs() - 1.0);
        z[20_000] = -0.0;
        z[30_000] = 0.0;
        z[40_000] = 0.0;
        check(
            &mut be,
            "signed zeros",
            &z,
            &[],
            &params(0.8, 40, 0.95, 0.0, 1.0, 64, V),
            false,
        );
        check(
            &mut be,
            "signed zeros, min-p 1",
            &z,
            &[],
            &params(0.8, 40, 1.0, 1.0, 1.0, 64, V),
            false,
        );
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
    fn multi_block_top_k_above_a_block_share_and_concentrated() {
        let mut be = pair();
        // top-k beyond the 1,024-token slice: every token of a block is a
        // candidate.
        let l = random(1_500, 7);
        check(
            &mut be,
            "k 1200 of 1500",
            &l,
            &[],
            &params(0.8, 1_200, 0.9, 0.0, 1.0, 64, 1_500),
            false,
        );
        check(
            &mut be,
            "k 1500 of 1500",
            &l,
            &[],
            &params(0.8, 1_500, 1.0, 0.0, 1.0, 64, 1_500),
            false,
        );
        check(
            &mut be,
            "k 5000 of 1500",
            &l,
            &[],
            &params(0.8, 5_000, 0.99, 0.0, 1.0, 64, 1_500),
            false,
        );
        // All strong candidates in one block (and across a slice edge).
        for (start, len) in [(7 * 1024 + 100, 300), (2048 - 20, 40), (V - 50, 50)] {
            let c = concentrated(V, start, len);
            let name = format!("concentrated at {start}+{len}");
            check(
                &mut be,
                &name,
                &c,
                &[],
                &params(0.8, 100, 0.95, 0.0, 1.0, 64, V),
                false,
            );
            check(
                &mut be,
                &name,
                &c,
                &[],
                &params(0.8, 40, 1.0, 0.0, 1.0, 64, V),
                true,
            );
            check(
                &mut be,
                &name,
                &c,
                &[],
                &params(0.8, 300, 0.999, 0.0, 1.0, 64, V),
                false,
            );
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: run by scripts/gpu.sh"]
    fn multi_block_min_p_top_p_and_degenerate_inputs() {
        let mut be = pair();
        let l = random(V, 9);
        let w = window(V);
        for (tp, mp) in [
            (0.0, 0.0),
            (1e-6, 0.0),
            (0.5, 0.0),
            (f32::NAN, 0.0),
            (1.0, 0.5),
            (1.0, 1.0),
            (0.95, 0.999),
            (0.95, f32::NAN),
        ] {
            let name = format!("top-p {tp}, min-p {mp}");
            check(
                &mut be,
                &name,
                &l,
                &w,
                &params(0.8, 40, tp, mp, 1.1, 64, V),
                false,
            );
        }
        // Temperatures: tiny (1/T overflows: the argmax), huge.
        check(
            &mut be,
            "T 1e-40",
            &l,
            &w,
            &params(1e-40, 40, 0.95, 0.0, 1.1, 64, V),
            false,
        );
        check(
            &mut be,
            "T 1e30",
            &l,
            &w,
            &params(1e30, 40, 0.95, 0.0, 1.1, 64, V),
            false,
        );
        // No filter (the dense transform) and greedy with a penalty.
        check(
            &mut be,
            "no filter",
            &l,
            &w,
            &params(0.8, 0, 1.0, 0.0, 1.1, 64, V),
            false,
        );
        check(
            &mut be,
            "greedy",
            &l,
            &w,
            &params(0.0, 40, 0.95, 0.0, 1.3, 64, V),
            false,
        );
        // A filter without top-k stays on the single-block kernel.
        check(
            &mut be,
            "top-p only",
            &l,
            &w,
            &params(0.8, 0, 0.9, 0.0, 1.1, 64, V),
            false,
        );
        // Masked (grammar) logits with NaN; everything masked; a +inf.
        let m = masked(V);
        check(
            &mut be,
            "masked",
            &m,
            &w,
            &params(0.8, 40, 0.95, 0.0, 1.1, 64, V),
            false,
        );
        check(
            &mut be,
            "masked, no filter",
            &m,
            &w,
            &params(0.8, 0, 1.0, 0.0, 1.1, 64, V),
            false,
        );
        let none = vec![f32::NEG_INFINITY; V as usize];
        check(
            &mut be,
            "all masked",
            &none,
            &w,
            &params(0.8, 40, 0.95, 0.0, 1.1, 64, V),
            false,
        );
        let mut inf = l.clone();
        inf[33_333] = f32::INFINITY;
        inf[44_444] = f32::INFINITY;
        check(
            &mut be,
            "+inf",
            &inf,
            &w,
            &params(0.8, 40, 0.95, 0.0, 1.1, 64, V),
            false,
        );
        // A window longer than the shared-memory de-duplication (1,024 ids).
        let long: Vec<u32> = (0..1_500).map(|j| (j * 31 + 7) % 3_000).collect();
        check(
            &mut be,
            "long window",
            &l,
            &long,
            &params(0.8, 40, 0.95, 0.0, 1.2, 1_500, V),
            false,
        );
    }
}
