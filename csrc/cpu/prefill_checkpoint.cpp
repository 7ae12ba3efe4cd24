// Store the internal prefill checkpoint (conv history + SSM state at an exact token position)
// into paged state blocks, on CPU.
//
// CPU twin of vLLM 0.32's Triton `_store_prefill_checkpoint_kernel`
// (vllm/model_executor/layers/mamba/ops/ssd_checkpoint.py, `store_prefill_checkpoint`), which
// has no CPU version. Same contract: for every prefill row r with checkpoint_offsets[r] > 0,
//   conv_state[state_indices[r], :, j] = x[:, query_start_loc[r] + offset - state_len + j]
//                                        for j in [0, state_len)
//   ssm_state[state_indices[r]]        = chunk_states[chunk_idx[r]]
// Rows with offset 0 write nothing.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"

namespace vllm_hybrid {

namespace {

at::Tensor host_long(const at::Tensor& t, const char* name, int64_t rows) {
  TORCH_CHECK(t.dim() == 1 && t.numel() >= rows, "store_prefill_checkpoint: ", name,
              " must be 1-D with at least ", rows, " entries, got ", t.sizes());
  return t.to(at::kLong).contiguous();
}

}  // namespace

void store_prefill_checkpoint(const at::Tensor& x, at::Tensor& conv_state,
                              const at::Tensor& chunk_states, at::Tensor& ssm_state,
                              const at::Tensor& query_start_loc,
                              const at::Tensor& checkpoint_offsets,
                              const at::Tensor& state_indices, const at::Tensor& chunk_idx,
                              int64_t state_len) {
  TORCH_CHECK(x.dim() == 2, "store_prefill_checkpoint: x must be (dim, tokens), got ", x.sizes());
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == x.size(0),
              "store_prefill_checkpoint: conv_state must be (blocks, dim, width) with dim = ",
              x.size(0), ", got ", conv_state.sizes());
  TORCH_CHECK(state_len > 0 && state_len <= conv_state.size(2),
              "store_prefill_checkpoint: state_len ", state_len, " must be in [1, ",
              conv_state.size(2), "]");
  TORCH_CHECK(ssm_state.dim() >= 2 && chunk_states.dim() == ssm_state.dim() &&
                  chunk_states.sizes().slice(1) == ssm_state.sizes().slice(1),
              "store_prefill_checkpoint: chunk_states ", chunk_states.sizes(),
              " and ssm_state ", ssm_state.sizes(), " must agree past their first dimension");
  const int64_t rows = checkpoint_offsets.numel();
  auto offsets = host_long(checkpoint_offsets, "checkpoint_offsets", rows);
  auto dst = host_long(state_indices, "state_indices", rows);
  auto src = host_long(chunk_idx, "chunk_idx", rows);
  auto starts = host_long(query_start_loc, "query_start_loc", rows + 1);
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* q = starts.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    if (off[r] <= 0) continue;
    TORCH_CHECK(off[r] >= state_len && off[r] <= q[r + 1] - q[r],
                "store_prefill_checkpoint: row ", r, " checkpoint offset ", off[r],
                " must lie in [state_len, query length] = [", state_len, ", ", q[r + 1] - q[r],
                "]");
    TORCH_CHECK(d[r] >= 0 && d[r] < conv_state.size(0) && d[r] < ssm_state.size(0),
                "store_prefill_checkpoint: row ", r, " destination block ", d[r],
                " out of range");
    TORCH_CHECK(s[r] >= 0 && s[r] < chunk_states.size(0), "store_prefill_checkpoint: row ", r,
                " chunk index ", s[r], " out of range [0, ", chunk_states.size(0), ")");
    const int64_t end = q[r] + off[r];
    conv_state.select(0, d[r]).narrow(1, 0, state_len).copy_(
        x.narrow(1, end - state_len, state_len));
    ssm_state.select(0, d[r]).copy_(chunk_states.select(0, s[r]));
  }
}

}  // namespace vllm_hybrid
