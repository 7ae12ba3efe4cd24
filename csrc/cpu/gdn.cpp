// Gated delta rule (Qwen3-Next / Qwen3.5 / OLMo-Hybrid GDN layers, and Kimi delta attention)
// on CPU in float32, sequential over tokens.
//
// Per value head, with state S (K x V), per token normalised q, k (K), v (V), decay d, beta b:
//
//   S <- diag(d) S                d = exp(g), computed in double and rounded once; g is one
//                                 value per head (GDN: every row scaled alike) or one per key
//                                 channel, i.e. per row of S (KDA)
//   u  = S^T k                    a sum over K
//   D  = (v - u) * b
//   S <- S + k D^T
//   o  = S^T q                    q already L2-normalised and scaled by 1/sqrt(K)
//
// Column v of S evolves on its own (u[v], D[v], o[v] read only column v), so a work item is
// (sequence, value head, block of 16 columns): its K x 16 slice of the state stays in L1 for
// the whole sequence, and every inner loop runs over 16 contiguous columns (one AVX-512
// register). Results do not depend on that blocking: no sum runs over V.
//
// The summation order is fixed, and it is the one vllm_hybrid/ops/gdn.py's pure-torch twin
// uses (lane_sum), so the two agree bit for bit:
//   - every sum over K: row i goes to lane i % 16, each lane adds its rows in index order
//     (starting from its first row), then the lanes fold by halving (n lanes, h = ceil(n/2):
//     lane i += lane i + h for i < n - h, until one lane is left);
//   - every product and every sum is one float32 operation: the kernels below are compiled
//     with fp-contract=off (no fused multiply-add; GCC's C++ default would contract);
//   - |q|, |k|: x * (1 / sqrt(sum x^2 + eps)), the same lane order over K; q then * scale.
// Since each token's step is a fixed function of (state, token), the state after n tokens is the
// same bits however the tokens are cut into calls: what makes prefix caching exact.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"

namespace vllm_hybrid {
namespace {

constexpr int64_t kLanes = 16;  // accumulator lanes of a sum over K (ops/gdn.py's LANES)
constexpr int64_t kCols = 16;   // value columns per work item (does not change results)

struct Strided3 {
  const float* p;
  int64_t s0, s1, s2;
  const float& at(int64_t a, int64_t b, int64_t c) const { return p[a * s0 + b * s1 + c * s2]; }
};

struct Strided2 {
  const float* p;
  int64_t s0, s1;
  float at(int64_t a, int64_t b) const { return p[a * s0 + b * s1]; }
};

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// Fold lanes [0, n) of acc (each kCols wide) into lane 0 by halving.
inline void fold_lanes(float (&acc)[kLanes][kCols], int64_t n) {
  while (n > 1) {
    const int64_t h = (n + 1) / 2;
    for (int64_t i = 0; i < n - h; ++i) {
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j) acc[i][j] = acc[i][j] + acc[i + h][j];
    }
    n = h;
  }
}

// L2-normalise x[0..K) (stride `stride`) into dst, times `scale` when scale != 1 is asked for.
inline void normalise(const float* x, int64_t stride, int64_t K, float eps, bool scaled,
                      float scale, float* dst) {
  float lanes[kLanes] = {0};  // K >= 1 (checked by the op)
  const int64_t nl = std::min(kLanes, K);
  for (int64_t i = 0; i < nl; ++i) lanes[i] = x[i * stride] * x[i * stride];
  for (int64_t i = nl; i < K; ++i) {
    const float xi = x[i * stride];
    lanes[i % kLanes] = lanes[i % kLanes] + xi * xi;
  }
  for (int64_t n = nl; n > 1;) {
    const int64_t h = (n + 1) / 2;
    for (int64_t i = 0; i < n - h; ++i) lanes[i] = lanes[i] + lanes[i + h];
    n = h;
  }
  const float inv = 1.f / std::sqrt(lanes[0] + eps);
  for (int64_t i = 0; i < K; ++i) {
    const float y = x[i * stride] * inv;
    dst[i] = scaled ? y * scale : y;
  }
}

struct RuleParams {
  int64_t K, V, Hk, Hv;
  const float* qn;  // (T, Hk, K) normalised and scaled q, contiguous
  const float* kn;  // (T, Hk, K) normalised k, contiguous
  Strided3 v;       // (T, Hv, V)
  const float* decay;  // (T, Hv, Kd) exp(g), contiguous; Kd = 1 (per head) or K (per row)
  int64_t Kd;
  Strided2 beta;    // (T, Hv)
  float* out;       // (T, Hv, V)
  int64_t o0, o1, o2;
};

// One work item: tokens [lo, hi) of one sequence, value head h, columns [c0, c0 + w), with the
// state slice blk (K x kCols, row-major; columns past w are zero and never written out).
__attribute__((target_clones("avx512f", "avx2", "default"))) void rule_block(
    const RuleParams& p, int64_t lo, int64_t hi, int64_t h, int64_t c0, int64_t w, float* blk) {
  const int64_t K = p.K, Hk = p.Hk, hk = h / (p.Hv / p.Hk);
  const int64_t full = K / kLanes * kLanes, nl = std::min(kLanes, K);
  float acc[kLanes][kCols];
  float vt[kCols] = {0}, delta[kCols];
  const int64_t dstep = p.Kd == 1 ? 0 : 1;  // row r's decay: dd[r * dstep]
  for (int64_t t = lo; t < hi; ++t) {
    const float* dd = p.decay + (t * p.Hv + h) * p.Kd;
    const float b = p.beta.at(t, h);
    const float* kk = p.kn + (t * Hk + hk) * K;
    const float* qq = p.qn + (t * Hk + hk) * K;
    for (int64_t j = 0; j < w; ++j) vt[j] = p.v.at(t, h, c0 + j);

    // S <- S * d and u = S^T k (lane order), first lane block assigned, the rest added
    for (int64_t l = 0; l < nl; ++l) {
      float* row = blk + l * kCols;
      const float kv = kk[l], d = dd[l * dstep];
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j) {
        row[j] = row[j] * d;
        acc[l][j] = row[j] * kv;
      }
    }
    for (int64_t r = kLanes; r < full; r += kLanes) {
#pragma GCC unroll 16
      for (int64_t l = 0; l < kLanes; ++l) {
        float* row = blk + (r + l) * kCols;
        const float kv = kk[r + l], d = dd[(r + l) * dstep];
#pragma omp simd
        for (int64_t j = 0; j < kCols; ++j) {
          row[j] = row[j] * d;
          acc[l][j] = acc[l][j] + row[j] * kv;
        }
      }
    }
    for (int64_t r = std::max(full, nl); r < K; ++r) {
      float* row = blk + r * kCols;
      const float kv = kk[r], d = dd[r * dstep];
      const int64_t l = r - full;
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j) {
        row[j] = row[j] * d;
        acc[l][j] = acc[l][j] + row[j] * kv;
      }
    }
    fold_lanes(acc, nl);
#pragma omp simd
    for (int64_t j = 0; j < kCols; ++j) delta[j] = (vt[j] - acc[0][j]) * b;

    // S <- S + k D^T and o = S^T q (lane order)
    for (int64_t l = 0; l < nl; ++l) {
      float* row = blk + l * kCols;
      const float kv = kk[l], qv = qq[l];
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j) {
        row[j] = row[j] + kv * delta[j];
        acc[l][j] = row[j] * qv;
      }
    }
    for (int64_t r = kLanes; r < full; r += kLanes) {
#pragma GCC unroll 16
      for (int64_t l = 0; l < kLanes; ++l) {
        float* row = blk + (r + l) * kCols;
        const float kv = kk[r + l], qv = qq[r + l];
#pragma omp simd
        for (int64_t j = 0; j < kCols; ++j) {
          row[j] = row[j] + kv * delta[j];
          acc[l][j] = acc[l][j] + row[j] * qv;
        }
      }
    }
    for (int64_t r = std::max(full, nl); r < K; ++r) {
      float* row = blk + r * kCols;
      const float kv = kk[r], qv = qq[r];
      const int64_t l = r - full;
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j) {
        row[j] = row[j] + kv * delta[j];
        acc[l][j] = acc[l][j] + row[j] * qv;
      }
    }
    fold_lanes(acc, nl);
    float* o = p.out + t * p.o0 + h * p.o1 + c0 * p.o2;
    for (int64_t j = 0; j < w; ++j) o[j * p.o2] = acc[0][j];
  }
}

#pragma GCC pop_options

at::Tensor as_f32(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat); }

}  // namespace

void gated_delta_rule_fwd(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                          at::Tensor& state, const at::Tensor& cu_seqlens,
                          const std::optional<at::Tensor>& state_indices,
                          const std::optional<at::Tensor>& has_initial_state, double scale,
                          bool output_final_state) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes(),
              "gated_delta_rule_fwd: q and k must be (tokens, key_heads, K), got ", q.sizes(),
              " and ", k.sizes());
  const int64_t T = q.size(0), Hk = q.size(1), K = q.size(2);
  TORCH_CHECK(K > 0, "gated_delta_rule_fwd: K must be positive");
  TORCH_CHECK(v.dim() == 3 && v.size(0) == T,
              "gated_delta_rule_fwd: v must be (tokens, value_heads, V), got ", v.sizes());
  const int64_t Hv = v.size(1), V = v.size(2);
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0, "gated_delta_rule_fwd: value heads (", Hv,
              ") must be a multiple of key heads (", Hk, ")");
  TORCH_CHECK(beta.dim() == 2 && beta.size(0) == T && beta.size(1) == Hv,
              "gated_delta_rule_fwd: beta must be (tokens, value_heads), got ", beta.sizes());
  TORCH_CHECK((g.dim() == 2 || (g.dim() == 3 && g.size(2) == K)) && g.size(0) == T &&
                  g.size(1) == Hv,
              "gated_delta_rule_fwd: g must be (tokens, value_heads) or (tokens, value_heads, K), "
              "got ", g.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 3 && out.size(0) == T &&
                  out.size(1) == Hv && out.size(2) == V,
              "gated_delta_rule_fwd: out must be float32 (tokens, value_heads, V), got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 4 && state.size(1) == Hv &&
                  state.size(2) == K && state.size(3) == V,
              "gated_delta_rule_fwd: state must be float32 (slots, ", Hv, ", ", K, ", ", V,
              "), got ", state.scalar_type(), " ", state.sizes());
  TORCH_CHECK(state.stride(3) == 1 && state.stride(2) == V && state.stride(1) == K * V,
              "gated_delta_rule_fwd: each state slot must be contiguous (any slot stride)");
  auto cu = cu_seqlens.to(at::kLong).contiguous();
  const int64_t B = cu.numel() - 1;
  TORCH_CHECK(B >= 0, "gated_delta_rule_fwd: cu_seqlens must have batch + 1 entries");
  const int64_t* bounds = cu.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(bounds[b] >= 0 && bounds[b] <= bounds[b + 1] && bounds[b + 1] <= T,
                "gated_delta_rule_fwd: cu_seqlens must rise from >= 0 to <= tokens (", T,
                "), got ", cu_seqlens);
  std::vector<int64_t> slot(B);
  if (state_indices.has_value()) {
    TORCH_CHECK(state_indices->numel() == B, "gated_delta_rule_fwd: state_indices has ",
                state_indices->numel(), " entries for ", B, " sequences");
    auto idx = state_indices->to(at::kLong).contiguous();
    std::copy_n(idx.data_ptr<int64_t>(), B, slot.begin());
  } else {
    for (int64_t b = 0; b < B; ++b) slot[b] = b;
  }
  std::vector<uint8_t> fresh(B, 0);
  if (has_initial_state.has_value()) {
    TORCH_CHECK(has_initial_state->numel() == B, "gated_delta_rule_fwd: has_initial_state has ",
                has_initial_state->numel(), " entries for ", B, " sequences");
    auto init = has_initial_state->to(at::kBool).contiguous();
    const bool* ip = init.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b) fresh[b] = !ip[b];
  }
  const int64_t slots = state.size(0);
  std::vector<int64_t> writer(output_final_state ? slots : 0, -1);
  for (int64_t b = 0; b < B; ++b) {
    if (slot[b] < 0 || bounds[b] == bounds[b + 1]) continue;  // padded slot / empty sequence
    TORCH_CHECK(slot[b] < slots, "gated_delta_rule_fwd: sequence ", b, " has state slot ",
                slot[b], " but the pool has ", slots);
    if (output_final_state) {
      TORCH_CHECK(writer[slot[b]] < 0, "gated_delta_rule_fwd: sequences ", writer[slot[b]],
                  " and ", b, " both write state slot ", slot[b]);
      writer[slot[b]] = b;
    }
  }
  if (T == 0 || B == 0) return;

  // q, k normalised once per (token, key head); the scale folded into q
  auto qf = as_f32(q), kf = as_f32(k), vf = as_f32(v), gf = as_f32(g), bf = as_f32(beta);
  // the decays once per (token, head[, row]): exp in double, rounded once
  const int64_t Kd = g.dim() == 3 ? K : 1;
  auto decay = at::empty({T, Hv, Kd}, q.options().dtype(at::kFloat));
  {
    const float* gp = gf.data_ptr<float>();
    float* dp = decay.data_ptr<float>();
    const int64_t gs0 = gf.stride(0), gs1 = gf.stride(1), gs2 = g.dim() == 3 ? gf.stride(2) : 0;
    at::parallel_for(0, T * Hv, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float* src = gp + i / Hv * gs0 + i % Hv * gs1;
        for (int64_t r = 0; r < Kd; ++r)
          dp[i * Kd + r] = static_cast<float>(std::exp(static_cast<double>(src[r * gs2])));
      }
    });
  }
  auto qn = at::empty({T, Hk, K}, q.options().dtype(at::kFloat));
  auto kn = at::empty({T, Hk, K}, q.options().dtype(at::kFloat));
  const float eps = static_cast<float>(1e-6), fscale = static_cast<float>(scale);
  {
    const float* qp = qf.data_ptr<float>();
    const float* kp = kf.data_ptr<float>();
    float* qo = qn.data_ptr<float>();
    float* ko = kn.data_ptr<float>();
    const int64_t qs0 = qf.stride(0), qs1 = qf.stride(1), qs2 = qf.stride(2);
    const int64_t ks0 = kf.stride(0), ks1 = kf.stride(1), ks2 = kf.stride(2);
    at::parallel_for(0, T * Hk, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / Hk, h = i % Hk;
        normalise(qp + t * qs0 + h * qs1, qs2, K, eps, true, fscale, qo + i * K);
        normalise(kp + t * ks0 + h * ks1, ks2, K, eps, false, 1.f, ko + i * K);
      }
    });
  }

  RuleParams p{K,
               V,
               Hk,
               Hv,
               qn.data_ptr<float>(),
               kn.data_ptr<float>(),
               {vf.data_ptr<float>(), vf.stride(0), vf.stride(1), vf.stride(2)},
               decay.data_ptr<float>(),
               Kd,
               {bf.data_ptr<float>(), bf.stride(0), bf.stride(1)},
               out.data_ptr<float>(),
               out.stride(0),
               out.stride(1),
               out.stride(2)};
  float* pool = state.data_ptr<float>();
  const int64_t slot_stride = state.stride(0);
  const int64_t nblocks = (V + kCols - 1) / kCols;
  at::parallel_for(0, B * Hv * nblocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> blk(K * kCols);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / (Hv * nblocks), h = job / nblocks % Hv, c = job % nblocks;
      const int64_t lo = bounds[b], hi = bounds[b + 1];
      if (slot[b] < 0 || lo == hi) continue;
      const int64_t c0 = c * kCols, w = std::min(kCols, V - c0);
      float* S = pool + slot[b] * slot_stride + h * K * V + c0;  // row r at S + r * V
      std::fill(blk.begin(), blk.end(), 0.f);
      if (!fresh[b])
        for (int64_t r = 0; r < K; ++r) std::copy_n(S + r * V, w, blk.data() + r * kCols);
      rule_block(p, lo, hi, h, c0, w, blk.data());
      if (output_final_state)
        for (int64_t r = 0; r < K; ++r) std::copy_n(blk.data() + r * kCols, w, S + r * V);
    }
  });
}

}  // namespace vllm_hybrid
