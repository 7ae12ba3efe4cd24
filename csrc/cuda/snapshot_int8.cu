// Int8 compressed snapshots on CUDA: quantize on save, dequantize on restore, one fp32 scale per
// group (dim 1 of each state tensor: a head of an SSM state, a channel of a conv state). CUDA
// twin of csrc/cpu/snapshot_int8.cpp with the same fp32 arithmetic (IEEE division, round half
// to even), so both agree bit for bit with each other and with the torch twin.
//
// Grid: x = groups of all tensors of one pair, kWarps per block, one warp per group (a warp-wide
// absmax reduction, then a second pass over the group that hits L1/L2); y = pairs (grid-stride
// past 65535). descs[t].group_begin is the prefix sum of groups.
#include <cuda_runtime.h>

#include <cstdint>

#include "snapshot_params.h"
#include "state_access.cuh"

namespace vllm_hybrid {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;

struct GroupRef {
  const QuantDesc* d;
  int64_t group;
};

__device__ __forceinline__ bool locate(const QuantParams& p, GroupRef& ref) {
  const int64_t global = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  if (global >= p.total_groups) return false;
  const int64_t t =
      find_desc(p.num_descs, global, [&](int64_t i) { return p.descs[i].group_begin; });
  ref = {p.descs + t, global - p.descs[t].group_begin};
  return true;
}

__global__ void __launch_bounds__(kThreads) quantize_kernel(const QuantParams p) {
  GroupRef ref;
  if (!locate(p, ref)) return;
  const QuantDesc& d = *ref.d;
  const int lane = threadIdx.x % 32;
  for (int64_t pair = blockIdx.y; pair < p.num_pairs; pair += gridDim.y) {
    const int64_t src = p.pairs[2 * pair], dst = p.pairs[2 * pair + 1];
    const int64_t x0 = src * d.x_block + ref.group * d.x_group;
    int8_t* q = d.q + dst * d.q_block + ref.group * d.q_group;
    float amax = 0.f;
    for (int64_t j = lane; j < d.group_elems; j += 32)
      amax = fmaxf(amax, fabsf(load_state(d.x, d.dtype, x0 + j * d.x_elem)));
#pragma unroll
    for (int m = 16; m > 0; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    const float s = amax / 127.f;
    if (lane == 0) d.scale[dst * d.s_block + ref.group * d.s_group] = s;
    for (int64_t j = lane; j < d.group_elems; j += 32) {
      const float v = s > 0.f ? rintf(load_state(d.x, d.dtype, x0 + j * d.x_elem) / s) : 0.f;
      q[j * d.q_elem] = static_cast<int8_t>(fminf(fmaxf(v, -127.f), 127.f));
    }
  }
}

__global__ void __launch_bounds__(kThreads) dequantize_kernel(const QuantParams p) {
  GroupRef ref;
  if (!locate(p, ref)) return;
  const QuantDesc& d = *ref.d;
  const int lane = threadIdx.x % 32;
  for (int64_t pair = blockIdx.y; pair < p.num_pairs; pair += gridDim.y) {
    const int64_t src = p.pairs[2 * pair], dst = p.pairs[2 * pair + 1];
    const int8_t* q = d.q + src * d.q_block + ref.group * d.q_group;
    const float s = d.scale[src * d.s_block + ref.group * d.s_group];
    const int64_t x0 = dst * d.x_block + ref.group * d.x_group;
    for (int64_t j = lane; j < d.group_elems; j += 32)
      store_state(d.x, d.dtype, x0 + j * d.x_elem, static_cast<float>(q[j * d.q_elem]) * s);
  }
}

int launch(const QuantParams& params, void* stream, bool save) {
  if (params.num_pairs == 0 || params.total_groups == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((params.total_groups + kWarps - 1) / kWarps),
                  static_cast<unsigned>(params.num_pairs < 65535 ? params.num_pairs : 65535));
  auto s = static_cast<cudaStream_t>(stream);
  if (save) quantize_kernel<<<grid, kThreads, 0, s>>>(params);
  else dequantize_kernel<<<grid, kThreads, 0, s>>>(params);
  return cudaGetLastError();
}

}  // namespace

int launch_snapshot_quantize_int8(const QuantParams& params, void* stream) {
  return launch(params, stream, /*save=*/true);
}

int launch_snapshot_dequantize_int8(const QuantParams& params, void* stream) {
  return launch(params, stream, /*save=*/false);
}

}  // namespace vllm_hybrid
