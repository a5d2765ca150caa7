// Each standalone sampling command of the table run through a backend's
// replay loop, against a direct computation (akunu_core::sampling).
//
// Shared by the CPU tests (sampling_kernels.rs, here) and the GPU tests
// (crates/akunu-cuda/tests/gpu_sampling_kernels.rs): the including file
// defines `fn backend(threads: usize) -> Box<dyn Backend>` and wraps each
// `pub fn` below in a #[test].

use akunu_core::backend::Backend;
use akunu_core::ops::*;
use akunu_core::sampling::{self, SamplingConfig, Scratch};
use akunu_core::table::{CmdBuilder, DispatchTable, PatchType, StepInfo};
use std::mem::offset_of;

const N: usize = 300;

fn logits(seed: u32) -> Vec<f32> {
    (0..N as u32)
        .map(|i| {
            ((sampling::uniform(seed as u64, i, 7) - 0.5) * 12.0).round() / 2.0 + i as f32 * 1e-3
        })
        .collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn recent_bytes(chain_start: u32, ids: &[u32]) -> Vec<u8> {
    let mut b = bytemuck::bytes_of(&RecentHeader {
        chain_start,
        n: ids.len() as u32,
    })
    .to_vec();
    b.extend(ids.iter().flat_map(|t| t.to_le_bytes()));
    b
}

fn run(be: &mut Box<dyn Backend>, t: &DispatchTable, step: StepInfo) {
    be.validate(t).unwrap();
    be.replay(t, step, 1, None).unwrap();
}

pub fn repetition_penalty_and_temperature_commands() {
    let mut be = backend(2);
    let l = logits(1);
    let lb = be.alloc((N * 4) as u64, "logits").unwrap();
    let rb = be.alloc(8 + 64 * 4, "recent").unwrap();
    be.write(lb, 0, &bytes(&l)).unwrap();
    let recent = [3u32, 5, 3, 250, 9999];
    be.write(rb, 0, &recent_bytes(0, &recent)).unwrap();
    let mut t = DispatchTable {
        max_rows: 1,
        ..Default::default()
    };
    CmdBuilder::new(&mut t, KernelId::RepetitionPenalty, 1)
        .buf(lb, 0)
        .buf(rb, 0)
        .params(&PenaltyParams {
            n_vocab: N as u32,
            penalty: 1.5,
            recent_capacity: 64,
            _pad: 0,
        })
        .emit();
    CmdBuilder::new(&mut t, KernelId::TemperatureScale, 1)
        .buf(lb, 0)
        .params(&TemperatureParams {
            n_vocab: N as u32,
            temperature: 0.5,
            _pad: [0; 2],
        })
        .emit();
    run(
        &mut be,
        &t,
        StepInfo {
            pos: 0,
            tok: 0,
            rows: 1,
        },
    );
    let got = be.read_f32s(lb, 0, N).unwrap();
    for i in 0..N {
        let mut want = l[i];
        if [3, 5, 250].contains(&i) {
            want = if want > 0.0 { want / 1.5 } else { want * 1.5 };
        }
        want /= 0.5;
        assert!(
            (got[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
            "token {i}: {} vs {want}",
            got[i]
        );
    }
}

pub fn bitmask_topk_and_argmax_commands() {
    let mut be = backend(2);
    let l = logits(2);
    let lb = be.alloc((N * 4) as u64, "logits").unwrap();
    let mb = be.alloc((N.div_ceil(32) * 4) as u64, "mask").unwrap();
    let kb = be.alloc(8 * 8, "top-k").unwrap();
    let tb = be.alloc(8, "tokens").unwrap();
    be.write(lb, 0, &bytes(&l)).unwrap();
    // Allow every third token only.
    let mut mask = vec![0u32; N.div_ceil(32)];
    for i in (0..N).step_by(3) {
        mask[i / 32] |= 1 << (i % 32);
    }
    be.write(
        mb,
        0,
        &mask
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let mut t = DispatchTable {
        max_rows: 1,
        ..Default::default()
    };
    CmdBuilder::new(&mut t, KernelId::GrammarBitmask, 1)
        .buf(lb, 0)
        .buf(mb, 0)
        .params(&BitmaskParams {
            n_vocab: N as u32,
            _pad: [0; 3],
        })
        .emit();
    CmdBuilder::new(&mut t, KernelId::TopKSelect, 1)
        .buf(lb, 0)
        .buf(kb, 0)
        .params(&TopKParams {
            n_vocab: N as u32,
            k: 8,
            _pad: [0; 2],
        })
        .emit();
    CmdBuilder::new(&mut t, KernelId::Argmax, 1)
        .buf(lb, 0)
        .buf(tb, 0)
        .params(&ArgmaxParams {
            n: N as u32,
            _pad: [0; 3],
        })
        .patch(PatchType::ArgmaxOutput, 0, 0)
        .emit();
    run(
        &mut be,
        &t,
        StepInfo {
            pos: 0,
            tok: 0,
            rows: 1,
        },
    );

    let got = be.read_f32s(lb, 0, N).unwrap();
    for i in 0..N {
        if i % 3 == 0 {
            assert_eq!(got[i], l[i]);
        } else {
            assert_eq!(got[i], f32::NEG_INFINITY, "token {i} should be masked");
        }
    }
    let mut allowed: Vec<(u32, f32)> = (0..N).step_by(3).map(|i| (i as u32, l[i])).collect();
    allowed.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let pairs = be.read_f32s(kb, 0, 16).unwrap();
    for j in 0..8 {
        assert_eq!(pairs[2 * j].to_bits(), allowed[j].0, "top-k id {j}");
        assert_eq!(pairs[2 * j + 1], allowed[j].1, "top-k value {j}");
    }
    assert_eq!(
        be.read_u32(tb, 1).unwrap(),
        allowed[0].0,
        "argmax lands in conveyor slot 1"
    );
}

pub fn gumbel_command_matches_the_library_transform_and_reads_the_chain() {
    let mut be = backend(1);
    let l = logits(3);
    let lb = be.alloc((N * 4) as u64, "logits").unwrap();
    let rb = be.alloc(8 + 64 * 4, "recent").unwrap();
    let cb = be.alloc(8 * 4, "conveyor").unwrap();
    be.write(lb, 0, &bytes(&l)).unwrap();
    let cfg = SamplingConfig {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.9,
        min_p: 0.01,
        repeat_penalty: 1.3,
        repeat_last_n: 4,
        seed: 77,
    };
    // Sequence before the chain: ..., 10, 11, 12; the chain produced 13 and 14
    // (conveyor slots 1 and 2) and this is step 2, at kv_len 102.
    be.write(rb, 0, &recent_bytes(100, &[10, 11, 12])).unwrap();
    be.write(
        cb,
        0,
        &[12u32, 13, 14, 0]
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let mut p = akunu_core::builder::sample_params(&cfg, N as u32);
    p.recent_capacity = 64;
    let mut t = DispatchTable {
        max_rows: 1,
        ..Default::default()
    };
    CmdBuilder::new(&mut t, KernelId::GumbelSample, 1)
        .buf(lb, 0)
        .buf(rb, 0)
        .buf(cb, 0)
        .params(&p)
        .patch(PatchType::KvSeqLen, offset_of!(SampleParams, kv_len), 0)
        .emit();
    run(
        &mut be,
        &t,
        StepInfo {
            pos: 101,
            tok: 0,
            rows: 1,
        },
    );
    let got = be.read_f32s(lb, 0, N).unwrap();

    // The window is the last 4 tokens of 10, 11, 12, 13, 14; the noise is
    // keyed by the produced token's position, kv_len = 102.
    let mut want = l.clone();
    sampling::gumbel_transform(&mut want, &[11, 12, 13, 14], &cfg, 102, &mut Scratch::new());
    for i in 0..N {
        assert!(
            got[i] == want[i] || (got[i].is_infinite() && want[i].is_infinite()),
            "token {i}: {} vs {}",
            got[i],
            want[i]
        );
    }
    let kept = got.iter().filter(|v| v.is_finite()).count();
    assert!(kept > 0 && kept <= 20, "top-k 20 keeps {kept}");
}
