// Mamba1 selective scan on CPU (Jamba's SSM layers), varlen, states in a slot pool.
//
// vLLM 0.32's CPU build has no `selective_scan_fwd` (mamba_ssm.py::selective_scan_fn calls
// torch.ops._C.selective_scan_fwd, which only the CUDA/ROCm builds register), so Jamba does
// not run on the CPU backend at all. This op takes the same arguments that function passes in
// its non-APC form (what vLLM 0.32's MambaMixer.forward_impl uses, align mode included) and
// runs, per channel d of D and state index n of N, the recurrence token by token:
//
//   delta_t = softplus(delta[d, t] + bias[d])          (if delta_softplus; threshold 20)
//   s[n]    = exp(delta_t * A[d, n]) * s[n] + B[g, n, t] * (delta_t * u[d, t])
//   y       = D[d] * u[d, t] + sum_n s[n] * C[g, n, t]     (n in order 0..N-1)
//   out[d, t] = y;  out_z[d, t] = y * silu(z[d, t])         (if z)
//
// Every rounding is fixed so that the op equals its torch twin (vllm_hybrid/ops/mamba1.py,
// selective_scan_ref) bit for bit and does not depend on the vector width or where a token sits
// in the batch: softplus, the decay exp and silu are computed in float64 and rounded once, each
// product and sum is one float32 operation (fp-contract=off: no fused multiply-add), the sum over
// n runs in index order. Because the recurrence is sequential, a state resumed from a snapshot
// continues bit-identically to an uninterrupted scan, whatever the prefill chunks were.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "ops.h"

namespace vllm_hybrid {
namespace {

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

struct Mamba1Params {
  int64_t dim, d_state, dim_per_group, total;
  const float* u;      // (D, T)
  const float* delta;  // (D, T)
  const float* A;      // (D, N)
  const float* B;      // (T, G, N)  (transposed copy, token-major)
  const float* C;      // (T, G, N)
  const float* Dv;     // (D,) or nullptr
  const float* z;      // (D, T) or nullptr
  const float* bias;   // (D,) or nullptr
  bool softplus;
  float* out;    // (D, T) pre-gate output
  float* out_z;  // (D, T) gated output, or nullptr
};

inline float softplus_f(float x) {
  return x <= 20.f ? static_cast<float>(std::log1p(std::exp(static_cast<double>(x)))) : x;
}

inline float silu_f(float x) {
  const double v = static_cast<double>(x);
  return static_cast<float>(v / (1.0 + std::exp(-v)));
}

// One (sequence, channel): tokens [start, end), running state s (N floats) in and out.
__attribute__((target_clones("avx512f", "avx2", "default"))) void scan_channel(
    const Mamba1Params& p, int64_t d, int64_t start, int64_t end, float* s, float* decay) {
  const int64_t N = p.d_state, T = p.total;
  const int64_t g = d / p.dim_per_group, G = p.dim / p.dim_per_group;
  const float* A = p.A + d * N;
  const float bias = p.bias != nullptr ? p.bias[d] : 0.f;
  const float Dd = p.Dv != nullptr ? p.Dv[d] : 0.f;
  for (int64_t t = start; t < end; ++t) {
    float dt = p.delta[d * T + t];
    if (p.bias != nullptr) dt = dt + bias;
    if (p.softplus) dt = softplus_f(dt);
    const float u = p.u[d * T + t];
    const float du = dt * u;
    for (int64_t n = 0; n < N; ++n)
      decay[n] = static_cast<float>(std::exp(static_cast<double>(dt * A[n])));
    const float* Bt = p.B + (t * G + g) * N;
    const float* Ct = p.C + (t * G + g) * N;
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) s[n] = decay[n] * s[n] + Bt[n] * du;
    float y = Dd * u;
    for (int64_t n = 0; n < N; ++n) y = y + s[n] * Ct[n];
    p.out[d * T + t] = y;
    if (p.z != nullptr) p.out_z[d * T + t] = y * silu_f(p.z[d * T + t]);
  }
}

#pragma GCC pop_options

at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

}  // namespace

void selective_scan_fwd(const at::Tensor& u, at::Tensor& delta, const at::Tensor& A,
                        const at::Tensor& B, const at::Tensor& C,
                        const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                        const std::optional<at::Tensor>& delta_bias, bool delta_softplus,
                        const at::Tensor& query_start_loc,
                        const std::optional<at::Tensor>& cache_indices,
                        const std::optional<at::Tensor>& has_initial_state,
                        at::Tensor& ssm_states, int64_t null_block_id) {
  TORCH_CHECK(u.dim() == 2, "selective_scan_fwd: u must be (dim, tokens), got ", u.sizes());
  const int64_t Dm = u.size(0), T = u.size(1);
  TORCH_CHECK(delta.sizes() == u.sizes(), "selective_scan_fwd: delta must match u ", u.sizes());
  TORCH_CHECK(A.dim() == 2 && A.size(0) == Dm, "selective_scan_fwd: A must be (dim, d_state)");
  const int64_t N = A.size(1);
  TORCH_CHECK(B.dim() == 3 && B.size(1) == N && B.size(2) == T && C.sizes() == B.sizes(),
              "selective_scan_fwd: B and C must be (groups, d_state, tokens), got ", B.sizes(),
              " and ", C.sizes());
  const int64_t G = B.size(0);
  TORCH_CHECK(G > 0 && Dm % G == 0, "selective_scan_fwd: dim (", Dm,
              ") not divisible by groups (", G, ")");
  TORCH_CHECK(!D.has_value() || D->numel() == Dm, "selective_scan_fwd: D must be (dim,)");
  TORCH_CHECK(!delta_bias.has_value() || delta_bias->numel() == Dm,
              "selective_scan_fwd: delta_bias must be (dim,)");
  TORCH_CHECK(!z.has_value() || z->sizes() == u.sizes(), "selective_scan_fwd: z must match u");
  TORCH_CHECK(ssm_states.dim() == 3 && ssm_states.size(1) == Dm && ssm_states.size(2) == N,
              "selective_scan_fwd: ssm_states must be (slots, dim, d_state), got ",
              ssm_states.sizes());
  auto qsl = query_start_loc.to(at::kLong).contiguous();
  const int64_t batch = qsl.numel() - 1;
  TORCH_CHECK(batch >= 0, "selective_scan_fwd: query_start_loc must have batch + 1 entries");
  const int64_t* S = qsl.data_ptr<int64_t>();
  TORCH_CHECK(S[0] == 0 && S[batch] == T, "selective_scan_fwd: query_start_loc must run from 0 "
              "to the token count ", T);
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(S[b] <= S[b + 1], "selective_scan_fwd: query_start_loc must not decrease");
  std::vector<int64_t> slot(batch);
  std::vector<bool> init(batch, false);
  at::Tensor idx, has;
  if (cache_indices.has_value()) {
    TORCH_CHECK(cache_indices->dim() == 1 && cache_indices->numel() == batch,
                "selective_scan_fwd: cache_indices must be (batch,) (the APC form with block "
                "indices is not supported on CPU)");
    idx = cache_indices->to(at::kLong).contiguous();
  }
  if (has_initial_state.has_value()) {
    TORCH_CHECK(has_initial_state->numel() == batch,
                "selective_scan_fwd: has_initial_state must be (batch,)");
    has = has_initial_state->to(at::kBool).contiguous();
  }
  for (int64_t b = 0; b < batch; ++b) {
    slot[b] = idx.defined() ? idx.data_ptr<int64_t>()[b] : b;
    init[b] = has.defined() && has.data_ptr<bool>()[b];
    TORCH_CHECK(slot[b] == null_block_id || (slot[b] >= 0 && slot[b] < ssm_states.size(0)),
                "selective_scan_fwd: state slot ", slot[b], " out of range");
  }

  auto uf = f32(u), df = f32(delta), Af = f32(A);
  // token-major copies of B and C: (T, G, N)
  auto Bf = B.to(at::kFloat).permute({2, 0, 1}).contiguous();
  auto Cf = C.to(at::kFloat).permute({2, 0, 1}).contiguous();
  at::Tensor Dvf, zf, biasf;
  if (D.has_value()) Dvf = f32(*D);
  if (z.has_value()) zf = f32(*z);
  if (delta_bias.has_value()) biasf = f32(*delta_bias);
  auto out = at::zeros({Dm, T}, u.options().dtype(at::kFloat));
  at::Tensor outz;
  if (z.has_value()) outz = at::zeros({Dm, T}, u.options().dtype(at::kFloat));

  Mamba1Params p{Dm, N, Dm / G, T, uf.data_ptr<float>(), df.data_ptr<float>(),
                 Af.data_ptr<float>(), Bf.data_ptr<float>(), Cf.data_ptr<float>(),
                 D.has_value() ? Dvf.data_ptr<float>() : nullptr,
                 z.has_value() ? zf.data_ptr<float>() : nullptr,
                 delta_bias.has_value() ? biasf.data_ptr<float>() : nullptr, delta_softplus,
                 out.data_ptr<float>(), z.has_value() ? outz.data_ptr<float>() : nullptr};
  // each sequence's running state, started from its slot (only the slots read, not the pool)
  auto finals = at::zeros({batch, Dm, N}, u.options().dtype(at::kFloat));
  for (int64_t b = 0; b < batch; ++b)
    if (init[b] && slot[b] != null_block_id) finals[b].copy_(ssm_states[slot[b]]);
  float* fin = finals.data_ptr<float>();
  at::parallel_for(0, batch * Dm, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> decay(N);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / Dm, d = job % Dm;
      if (slot[b] == null_block_id) continue;
      float* s = fin + (b * Dm + d) * N;
      scan_channel(p, d, S[b], S[b + 1], s, decay.data());
    }
  });
  delta.copy_(out);
  if (z.has_value()) z->copy_(outz);
  for (int64_t b = 0; b < batch; ++b)
    if (slot[b] != null_block_id) ssm_states[slot[b]].copy_(finals[b]);
}

}  // namespace vllm_hybrid
