// Device helpers shared by the CUDA kernels: typed loads / stores of float state elements whose
// dtype is known only at run time (StateDType), and a binary search over descriptor tables.
// Includes only CUDA headers and snapshot_params.h, so the kernels compile with nvcc alone.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "snapshot_params.h"

namespace vllm_hybrid {

__device__ __forceinline__ float load_state(const char* base, int64_t dtype, int64_t index) {
  switch (dtype) {
    case kStateF32: return reinterpret_cast<const float*>(base)[index];
    case kStateF16: return __half2float(reinterpret_cast<const __half*>(base)[index]);
    default: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[index]);
  }
}

// Round to nearest even, the same conversion torch's .to(dtype) does on CPU.
__device__ __forceinline__ void store_state(char* base, int64_t dtype, int64_t index, float v) {
  switch (dtype) {
    case kStateF32: reinterpret_cast<float*>(base)[index] = v; break;
    case kStateF16: reinterpret_cast<__half*>(base)[index] = __float2half_rn(v); break;
    default: reinterpret_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(v);
  }
}

// Index of the last entry whose `begin` (a prefix sum) is <= item; begin(0) == 0.
template <typename Begin>
__device__ __forceinline__ int64_t find_desc(int64_t n, int64_t item, Begin begin) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (begin(mid) <= item) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace vllm_hybrid
