// Fused batched snapshot save / restore on CUDA: one launch copies, for every (source block,
// destination block) pair, the state of every listed tensor (conv and SSM state of all
// recurrent layers). CUDA twin of csrc/cpu/snapshot.cpp; the torch glue is ops_torch.cpp.
//
// Grid: x = tiles of kTileBytes over all tensors of one pair (a tile never straddles two
// tensors; descs[t].tile_begin is the prefix sum), y = pairs (grid-stride when more than 65535).
// Each thread moves kUnroll vectors of vec_bytes (16-byte uint4 loads / stores when both bases,
// both block strides and the span are 16-byte aligned; narrower otherwise). Either side may be
// pinned host memory (mapped through unified addressing), which turns the kernel into a
// zero-copy device <-> host transfer.
#include <cuda_runtime.h>

#include <cstdint>

#include "snapshot_params.h"
#include "state_access.cuh"

namespace vllm_hybrid {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kTileBytes = int64_t{16} * kThreads * kUnroll;  // 16 KiB

template <typename V>
__device__ __forceinline__ void copy_tile(const char* __restrict__ src, char* __restrict__ dst,
                                          int64_t bytes) {
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t base = 0; base < n; base += int64_t{kUnroll} * kThreads) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads + threadIdx.x;
      if (i < n) r[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads + threadIdx.x;
      if (i < n) d[i] = r[u];
    }
  }
}

__global__ void __launch_bounds__(kThreads) snapshot_copy_kernel(const CopyParams p) {
  const int64_t tile = blockIdx.x;
  const int64_t t = find_desc(p.num_descs, tile, [&](int64_t i) { return p.descs[i].tile_begin; });
  const CopyDesc d = p.descs[t];
  const int64_t offset = (tile - d.tile_begin) * p.tile_bytes;
  const int64_t bytes = min(p.tile_bytes, d.span_bytes - offset);
  for (int64_t pair = blockIdx.y; pair < p.num_pairs; pair += gridDim.y) {
    const char* src = d.src + p.pairs[2 * pair] * d.src_block_bytes + offset;
    char* dst = d.dst + p.pairs[2 * pair + 1] * d.dst_block_bytes + offset;
    switch (d.vec_bytes) {
      case 16: copy_tile<uint4>(src, dst, bytes); break;
      case 8: copy_tile<uint2>(src, dst, bytes); break;
      case 4: copy_tile<uint32_t>(src, dst, bytes); break;
      case 2: copy_tile<uint16_t>(src, dst, bytes); break;
      default: copy_tile<uint8_t>(src, dst, bytes);
    }
  }
}

}  // namespace

// The glue fills descs[].tile_begin with tiles of `snapshot_copy_tile_bytes()` bytes.
int64_t snapshot_copy_tile_bytes() { return kTileBytes; }

int launch_snapshot_copy(const CopyParams& params, void* stream) {
  if (params.num_pairs == 0 || params.total_tiles == 0) return cudaSuccess;
  if (params.tile_bytes != kTileBytes) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(params.total_tiles),
                  static_cast<unsigned>(params.num_pairs < 65535 ? params.num_pairs : 65535));
  snapshot_copy_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(params);
  return cudaGetLastError();
}

}  // namespace vllm_hybrid
