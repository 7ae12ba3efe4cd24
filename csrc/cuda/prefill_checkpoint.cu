// Store the internal prefill checkpoint (conv history + SSM state at an exact token position)
// into paged state blocks, on CUDA. Same op name, schema and contract as the CPU op
// (csrc/cpu/prefill_checkpoint.cpp); for every prefill row r with checkpoint_offsets[r] > 0:
//   conv_state[state_indices[r], :, j] = x[:, query_start_loc[r] + offset - state_len + j]
//   ssm_state[state_indices[r]]        = chunk_states[chunk_idx[r]]          (cast)
//
// Grid: y = rows, x = tiles over the row's dim * state_len conv elements followed by its SSM
// elements (channel fastest, so the (tokens, dim)-major x and the SD conv layout coalesce). The
// index tensors live on the device, so their values are checked here: a row whose indices are
// out of range is skipped (nothing out of bounds is written) and raises error_flag when given.
#include <cuda_runtime.h>

#include <cstdint>

#include "snapshot_params.h"
#include "state_access.cuh"

namespace vllm_hybrid {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 4;

__global__ void __launch_bounds__(kThreads)
    store_checkpoint_kernel(const PrefillCheckpointParams p) {
  const int64_t r = blockIdx.y;
  const int64_t off = p.checkpoint_offsets[r];
  if (off <= 0) return;
  const int64_t q0 = p.query_start_loc[r], len = p.query_start_loc[r + 1] - q0;
  const int64_t blk = p.state_indices[r], c = p.chunk_idx[r];
  if (off < p.state_len || off > len || blk < 0 || blk >= p.conv_blocks || blk >= p.ssm_blocks ||
      c < 0 || c >= p.num_chunks) {
    if (p.error_flag != nullptr && threadIdx.x == 0) atomicExch(p.error_flag, 1);
    return;
  }
  const int64_t conv_n = p.dim * p.state_len;
  const int64_t s1 = p.inner[1], s2 = p.inner[2];
  const int64_t total = conv_n + p.inner[0] * s1 * s2;
  const int64_t first_tok = q0 + off - p.state_len;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (i < conv_n) {
      const int64_t ch = i % p.dim, j = i / p.dim;
      const float v = load_state(p.x, p.x_dtype,
                                 ch * p.x_stride_dim + (first_tok + j) * p.x_stride_tok);
      store_state(p.conv, p.conv_dtype,
                  blk * p.conv_stride_block + ch * p.conv_stride_dim + j * p.conv_stride_col, v);
    } else {
      const int64_t k = i - conv_n;
      const int64_t i2 = k % s2, i1 = (k / s2) % s1, i0 = k / (s1 * s2);
      const int64_t* cs = p.chunks_stride;
      const int64_t* ss = p.ssm_stride;
      const float v =
          load_state(p.chunks, p.chunks_dtype, c * cs[0] + i0 * cs[1] + i1 * cs[2] + i2 * cs[3]);
      store_state(p.ssm, p.ssm_dtype, blk * ss[0] + i0 * ss[1] + i1 * ss[2] + i2 * ss[3], v);
    }
  }
}

}  // namespace

int launch_store_prefill_checkpoint(const PrefillCheckpointParams& params, void* stream) {
  if (params.rows == 0) return cudaSuccess;
  const int64_t total = params.dim * params.state_len +
                        params.inner[0] * params.inner[1] * params.inner[2];
  const int64_t per_block = int64_t{kThreads} * kPerThread;
  const int64_t tiles = (total + per_block - 1) / per_block;
  const dim3 grid(static_cast<unsigned>(tiles > 0 ? tiles : 1), static_cast<unsigned>(params.rows));
  store_checkpoint_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(params);
  return cudaGetLastError();
}

}  // namespace vllm_hybrid
