// Int8 compressed snapshots on CPU: quantize on save, dequantize on restore, one fp32 scale per
// group (dim 1 of every state tensor: a head of an SSM state (H, P, N), a channel of a conv state
// (dim, width)). CPU twin of csrc/cuda/snapshot_int8.cu; the arithmetic is the same fp32
// sequence in both and in the torch twin, so all three agree bit for bit:
//
//   scale = absmax(group) / 127            (0 for an all-zero group)
//   q     = clamp(rint(x / scale), -127, 127)   (round half to even; 0 where scale == 0)
//   deq   = (float)q * scale, cast to the state's dtype (round to nearest even)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "snapshot_desc.h"

namespace vllm_hybrid {
namespace {

// Hot loops over a contiguous fp32 group, cloned per ISA (GCC picks the widest at load time).
__attribute__((target_clones("avx512f", "avx2", "default"))) float absmax(const float* x,
                                                                          int64_t n) {
  float m = 0.f;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = std::max(m, std::fabs(x[j]));
  return m;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void round_to_int8(
    const float* x, int64_t n, float s, int8_t* q) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j)
    q[j] = static_cast<int8_t>(std::clamp(std::rint(x[j] / s), -127.f, 127.f));
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void scale_int8(const int8_t* q,
                                                                             int64_t n, float s,
                                                                             float* x) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] = static_cast<float>(q[j]) * s;
}

// Per-thread scratch for groups that are strided or not fp32 (gathered to contiguous fp32).
struct Scratch {
  std::vector<float> x;
  std::vector<int8_t> q;
};

template <typename T>
void quantize_group(const T* x, int64_t x_elem, int8_t* q, int64_t q_elem, float* scale,
                    int64_t n, Scratch& tmp) {
  const float* xf = nullptr;
  if constexpr (std::is_same_v<T, float>) xf = x;
  if (!std::is_same_v<T, float> || x_elem != 1) {
    tmp.x.resize(n);
    for (int64_t j = 0; j < n; ++j) tmp.x[j] = static_cast<float>(x[j * x_elem]);
    xf = tmp.x.data();
  }
  const float s = absmax(xf, n) / 127.f;
  *scale = s;
  if (q_elem != 1) tmp.q.resize(n);
  int8_t* out = q_elem == 1 ? q : tmp.q.data();
  if (s > 0.f) round_to_int8(xf, n, s, out);
  else std::fill(out, out + n, int8_t{0});
  if (q_elem != 1)
    for (int64_t j = 0; j < n; ++j) q[j * q_elem] = out[j];
}

template <typename T>
void dequantize_group(const int8_t* q, int64_t q_elem, float s, T* x, int64_t x_elem,
                      int64_t n, Scratch& tmp) {
  const int8_t* in = q;
  if (q_elem != 1) {
    tmp.q.resize(n);
    for (int64_t j = 0; j < n; ++j) tmp.q[j] = q[j * q_elem];
    in = tmp.q.data();
  }
  if constexpr (std::is_same_v<T, float>) {
    if (x_elem == 1) {
      scale_int8(in, n, s, x);
      return;
    }
  }
  tmp.x.resize(n);
  scale_int8(in, n, s, tmp.x.data());
  for (int64_t j = 0; j < n; ++j) x[j * x_elem] = static_cast<T>(tmp.x[j]);
}

template <typename T>
T* typed(char* base) {
  return reinterpret_cast<T*>(base);
}

// One group of one tensor for one pair. save: x[src] -> q[dst], scale[dst]; restore:
// q[src], scale[src] -> x[dst].
void run_group(const QuantDesc& d, int64_t src, int64_t dst, int64_t g, bool save,
               Scratch& tmp) {
  const int64_t xb = save ? src : dst, qb = save ? dst : src;
  const int64_t x_off = xb * d.x_block + g * d.x_group;
  int8_t* q = d.q + qb * d.q_block + g * d.q_group;
  float* s = d.scale + qb * d.s_block + g * d.s_group;
  const int64_t n = d.group_elems;
  switch (d.dtype) {
    case kStateF32:
      if (save) quantize_group(typed<float>(d.x) + x_off, d.x_elem, q, d.q_elem, s, n, tmp);
      else dequantize_group(q, d.q_elem, *s, typed<float>(d.x) + x_off, d.x_elem, n, tmp);
      break;
    case kStateF16:
      if (save)
        quantize_group(typed<c10::Half>(d.x) + x_off, d.x_elem, q, d.q_elem, s, n, tmp);
      else
        dequantize_group(q, d.q_elem, *s, typed<c10::Half>(d.x) + x_off, d.x_elem, n, tmp);
      break;
    default:
      if (save)
        quantize_group(typed<c10::BFloat16>(d.x) + x_off, d.x_elem, q, d.q_elem, s, n, tmp);
      else
        dequantize_group(q, d.q_elem, *s, typed<c10::BFloat16>(d.x) + x_off, d.x_elem, n, tmp);
  }
}

void check_cpu(at::TensorList tensors, const char* op, const char* list) {
  for (size_t i = 0; i < tensors.size(); ++i)
    TORCH_CHECK(tensors[i].device().is_cpu(), op, ": ", snapshot::tname(list, i), " is on ",
                tensors[i].device(), "; the CPU op needs every tensor on the CPU");
}

void run(at::TensorList states, at::TensorList q_tensors, at::TensorList scales,
         const at::Tensor& pairs, bool save, const char* op) {
  check_cpu(states, op, "states");
  check_cpu(q_tensors, op, "q_tensors");
  check_cpu(scales, op, "scales");
  snapshot::PairCheck check;
  const auto descs = snapshot::quant_descs(states, q_tensors, scales, !save, check, op);
  const auto p = snapshot::checked_pairs(pairs, check, op);
  const int64_t n = p.size(0);
  if (n == 0 || descs.empty()) return;
  std::vector<int64_t> group_begin(descs.size() + 1, 0);
  for (size_t t = 0; t < descs.size(); ++t)
    group_begin[t + 1] = group_begin[t] + descs[t].groups;
  const int64_t per_pair = group_begin.back();
  const int64_t* pr = p.data_ptr<int64_t>();
  at::parallel_for(0, n * per_pair, 16, [&](int64_t begin, int64_t end) {
    Scratch tmp;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / per_pair, group = item % per_pair;
      const size_t t =
          std::upper_bound(group_begin.begin(), group_begin.end(), group) - group_begin.begin() - 1;
      run_group(descs[t], pr[2 * pair], pr[2 * pair + 1], group - group_begin[t], save, tmp);
    }
  });
}

}  // namespace

void snapshot_quantize_int8(at::TensorList states, at::TensorList q_tensors,
                            at::TensorList scales, const at::Tensor& pairs) {
  run(states, q_tensors, scales, pairs, /*save=*/true, "snapshot_quantize_int8");
}

void snapshot_dequantize_int8(at::TensorList q_tensors, at::TensorList scales,
                              at::TensorList states, const at::Tensor& pairs) {
  run(states, q_tensors, scales, pairs, /*save=*/false, "snapshot_dequantize_int8");
}

}  // namespace vllm_hybrid
