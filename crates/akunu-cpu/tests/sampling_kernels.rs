//! The standalone sampling commands through the CPU backend's replay loop
//! (the test bodies are shared with the CUDA backend's GPU tests).

use akunu_core::backend::Backend;

fn backend(threads: usize) -> Box<dyn Backend> {
    Box::new(akunu_cpu::CpuBackend::new(threads))
}

mod body {
    use super::backend;
    include!("shared/sampling_kernels_body.rs");
}

#[test]
fn repetition_penalty_and_temperature_commands() {
    body::repetition_penalty_and_temperature_commands()
}

#[test]
fn bitmask_topk_and_argmax_commands() {
    body::bitmask_topk_and_argmax_commands()
}

#[test]
fn gumbel_command_matches_the_library_transform_and_reads_the_chain() {
    body::gumbel_command_matches_the_library_transform_and_reads_the_chain()
}
