// Declarations of the CPU ops registered in csrc/bindings.cpp (namespace torch.ops.vllm_hybrid).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace vllm_hybrid {

at::Tensor ssd_scan_fwd(at::Tensor& out, const at::Tensor& x, const at::Tensor& dt,
                        const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                        const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                        const std::optional<at::Tensor>& initial_states,
                        const at::Tensor& cu_seqlens, const at::Tensor& cu_chunk_seqlens,
                        const at::Tensor& chunk_seq_idx);

void store_prefill_checkpoint(const at::Tensor& x, at::Tensor& conv_state,
                              const at::Tensor& chunk_states, at::Tensor& ssm_state,
                              const at::Tensor& query_start_loc,
                              const at::Tensor& checkpoint_offsets,
                              const at::Tensor& state_indices, const at::Tensor& chunk_idx,
                              int64_t state_len);

// Gated delta rule, float32, sequential over tokens (csrc/cpu/gdn.cpp).
void gated_delta_rule_fwd(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                          at::Tensor& state, const at::Tensor& cu_seqlens,
                          const std::optional<at::Tensor>& state_indices,
                          const std::optional<at::Tensor>& has_initial_state, double scale,
                          bool output_final_state);

// Snapshot ops (csrc/cpu/snapshot*.cpp; CUDA twins in csrc/cuda/, registered there).
void selective_scan_fwd(const at::Tensor& u, at::Tensor& delta, const at::Tensor& A,
                        const at::Tensor& B, const at::Tensor& C,
                        const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                        const std::optional<at::Tensor>& delta_bias, bool delta_softplus,
                        const at::Tensor& query_start_loc,
                        const std::optional<at::Tensor>& cache_indices,
                        const std::optional<at::Tensor>& has_initial_state,
                        at::Tensor& ssm_states, int64_t null_block_id);

void snapshot_copy(at::TensorList src_tensors, at::TensorList dst_tensors,
                   const at::Tensor& pairs);

void snapshot_quantize_int8(at::TensorList states, at::TensorList q_tensors,
                            at::TensorList scales, const at::Tensor& pairs);

void snapshot_dequantize_int8(at::TensorList q_tensors, at::TensorList scales,
                              at::TensorList states, const at::Tensor& pairs);

}  // namespace vllm_hybrid
