// Registers the vllm_hybrid custom ops with the PyTorch dispatcher (torch.ops.vllm_hybrid.*).
// The Python side (vllm_hybrid/ops/_loader.py) imports the extension module, which runs these
// registrations; the schemas state which arguments are mutated (Tensor(a!)).
#include <torch/extension.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(vllm_hybrid, m) {
  m.def(
      "ssd_scan_fwd(Tensor(a!) out, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
      "Tensor? D, Tensor? z, Tensor? initial_states, Tensor cu_seqlens, "
      "Tensor cu_chunk_seqlens, Tensor chunk_seq_idx) -> Tensor");
  m.def(
      "store_prefill_checkpoint(Tensor x, Tensor(a!) conv_state, Tensor chunk_states, "
      "Tensor(b!) ssm_state, Tensor query_start_loc, Tensor checkpoint_offsets, "
      "Tensor state_indices, Tensor chunk_idx, int state_len) -> ()");
  m.def(
      "gated_delta_rule_fwd(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor g, "
      "Tensor beta, Tensor(b!) state, Tensor cu_seqlens, Tensor? state_indices, "
      "Tensor? has_initial_state, float scale, bool output_final_state) -> ()");
  m.def(
      "selective_scan_fwd(Tensor u, Tensor(a!) delta, Tensor A, Tensor B, Tensor C, Tensor? D, "
      "Tensor(b!)? z, Tensor? delta_bias, bool delta_softplus, Tensor query_start_loc, "
      "Tensor? cache_indices, Tensor? has_initial_state, Tensor(c!) ssm_states, "
      "int null_block_id) -> ()");
  m.def("snapshot_copy(Tensor[] src_tensors, Tensor(a!)[] dst_tensors, Tensor pairs) -> ()");
  m.def(
      "snapshot_quantize_int8(Tensor[] states, Tensor(a!)[] q_tensors, Tensor(b!)[] scales, "
      "Tensor pairs) -> ()");
  m.def(
      "snapshot_dequantize_int8(Tensor[] q_tensors, Tensor[] scales, Tensor(a!)[] states, "
      "Tensor pairs) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_hybrid, CPU, m) {
  m.impl("ssd_scan_fwd", &vllm_hybrid::ssd_scan_fwd);
  m.impl("store_prefill_checkpoint", &vllm_hybrid::store_prefill_checkpoint);
  m.impl("gated_delta_rule_fwd", &vllm_hybrid::gated_delta_rule_fwd);
  m.impl("selective_scan_fwd", &vllm_hybrid::selective_scan_fwd);
  m.impl("snapshot_copy", &vllm_hybrid::snapshot_copy);
  m.impl("snapshot_quantize_int8", &vllm_hybrid::snapshot_quantize_int8);
  m.impl("snapshot_dequantize_int8", &vllm_hybrid::snapshot_dequantize_int8);
}

// The CUDA implementations (same schemas) are registered for the CUDA dispatch key by
// csrc/cuda/ops_torch.cpp, which setup.py compiles only into a CUDA build.

// An importable module so that `import vllm_hybrid._C` loads the library above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.doc() = "vllm-hybrid custom ops"; }
