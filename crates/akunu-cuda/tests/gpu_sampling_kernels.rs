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
