//! Times the in-chain sampling transform at the default model's vocabulary
//! size for a few configurations: `cargo run --release -p akunu-cpu --example sampler_bench`.

use akunu_core::sampling::{self, SamplingConfig, Scratch};
use std::time::Instant;

fn main() {
    let n = 49152;
    // Long-tailed logits like a real model's: a few large, most small.
    let base: Vec<f32> = (0..n as u32)
        .map(|i| (sampling::uniform(1, i, 2) * 8.0).powi(2) / 8.0 - (i % 97) as f32 * 0.05)
        .collect();
    let recent: Vec<u32> = (0..64).map(|i| i * 31 % n as u32).collect();
    let configs = [
        (
            "temperature 0.8",
            SamplingConfig {
                temperature: 0.8,
                seed: 1,
                ..Default::default()
            },
        ),
        (
            "T 0.8, top-k 40, top-p 0.95, penalty 1.1",
            SamplingConfig {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                repeat_penalty: 1.1,
                seed: 1,
                ..Default::default()
            },
        ),
        (
            "T 0.7, top-p 0.9",
            SamplingConfig {
                temperature: 0.7,
                top_p: 0.9,
                seed: 1,
                ..Default::default()
            },
        ),
        (
            "T 0.7, min-p 0.05",
            SamplingConfig {
                temperature: 0.7,
                min_p: 0.05,
                seed: 1,
                ..Default::default()
            },
        ),
        (
            "T 0.8, top-k 40",
            SamplingConfig {
                temperature: 0.8,
                top_k: 40,
                seed: 1,
                ..Default::default()
            },
        ),
        (
            "T 0.8, top-p 0.95",
            SamplingConfig {
                temperature: 0.8,
                top_p: 0.95,
                seed: 1,
                ..Default::default()
            },
        ),
        (
            "T 0.8, penalty 1.1",
            SamplingConfig {
                temperature: 0.8,
                repeat_penalty: 1.1,
                seed: 1,
                ..Default::default()
            },
        ),
    ];
    let mut scratch = Scratch::new();
    let mut l = base.clone();
    for (name, cfg) in configs {
        let mut times = Vec::new();
        for pos in 0..200u32 {
            l.copy_from_slice(&base);
            let t = Instant::now();
            sampling::gumbel_transform(&mut l, &recent, &cfg, pos, &mut scratch);
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        times.sort_by(|a, b| a.total_cmp(b));
        println!(
            "{name:<44} median {:>7.1} us  min {:>7.1} us",
            times[100], times[0]
        );
    }
}
