// Mamba2 SSD scan on CPU that also returns the state at the end of every logical chunk.
//
// vLLM 0.32's CPU scan (vllm/model_executor/layers/mamba/ops/cpu/mamba_ssm.py,
// _mamba_chunk_scan_combined_fwd_cpu) returns only each sequence's final state and ignores
// `return_intermediate_states`; align-mode prefix caching needs the state at the logical chunk
// that ends on the prefill checkpoint (mamba_mixer2.py indexes `varlen_states` by
// `checkpoint_chunk_idx`). This kernel runs the exact recurrence token by token in fp32
//
//   s_t = exp(dt_t * A_h) * s_{t-1} + dt_t * x_t (outer) B_t          s: (P, N) per head
//   y_t = s_t . C_t + D_h * x_t   [* silu(z_t)]
//
// and copies s at the last token of every logical chunk. Because the recurrence is sequential,
// a state resumed from a snapshot continues bit-identically to an uninterrupted scan.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "ops.h"

namespace vllm_hybrid {
namespace {

struct ScanParams {
  int64_t heads, head_dim, d_state, heads_per_group;
  const float* x;        // (T, H, P)
  const float* dt;       // (T, H), already biased / softplus'ed / clamped
  const float* A;        // (H,)
  const float* B;        // (T, G, N)
  const float* C;        // (T, G, N)
  const float* D;        // (H,) or nullptr
  const float* z;        // (T, H, P) or nullptr
  const float* init;     // (batch, H, P, N) or nullptr
  float* y;              // (T, H, P)
  float* chunk_states;   // (nchunks, H, P, N)
};

// One (sequence, head): walk its chunks in order, token by token. The running state is kept
// transposed, s[n][i] (N x P), so both the update and the output y[i] = sum_n s[n][i] C[n]
// vectorize over i with no horizontal reductions; it is transposed back to (P, N) only when
// copied in or out. Cloned per ISA (GCC picks the widest the CPU supports at load time).
__attribute__((target_clones("avx512f", "avx2", "default"))) void scan_one(
    const ScanParams& p, int64_t seq, int64_t h, const int64_t* chunk_bounds,
    int64_t first_chunk, int64_t end_chunk, std::vector<float>& s, std::vector<float>& tmp) {
  const int64_t P = p.head_dim, N = p.d_state, H = p.heads;
  const int64_t g = h / p.heads_per_group, G = H / p.heads_per_group;
  float* xdt = tmp.data();
  float* y = tmp.data() + P;
  for (int64_t i = 0; i < P; ++i)
    for (int64_t n = 0; n < N; ++n)
      s[n * P + i] = p.init != nullptr ? p.init[((seq * H + h) * P + i) * N + n] : 0.f;
  const float A = p.A[h];
  const float Dh = p.D != nullptr ? p.D[h] : 0.f;
  for (int64_t c = first_chunk; c < end_chunk; ++c) {
    for (int64_t t = chunk_bounds[c]; t < chunk_bounds[c + 1]; ++t) {
      const float dt = p.dt[t * H + h];
      const float decay = std::exp(dt * A);
      const float* Bt = p.B + (t * G + g) * N;
      const float* Ct = p.C + (t * G + g) * N;
      const float* xt = p.x + (t * H + h) * P;
#pragma omp simd
      for (int64_t i = 0; i < P; ++i) {
        xdt[i] = xt[i] * dt;
        y[i] = Dh * xt[i];
      }
      for (int64_t n = 0; n < N; ++n) {
        float* sn = s.data() + n * P;
        const float b = Bt[n], cc = Ct[n];
#pragma omp simd
        for (int64_t i = 0; i < P; ++i) {
          sn[i] = sn[i] * decay + xdt[i] * b;
          y[i] += sn[i] * cc;
        }
      }
      float* yt = p.y + (t * H + h) * P;
      for (int64_t i = 0; i < P; ++i) {
        float out = y[i];
        if (p.z != nullptr) {
          const float zv = p.z[(t * H + h) * P + i];
          out *= zv / (1.f + std::exp(-zv));
        }
        yt[i] = out;
      }
    }
    float* dst = p.chunk_states + (c * H + h) * P * N;
    for (int64_t i = 0; i < P; ++i)
      for (int64_t n = 0; n < N; ++n) dst[i * N + n] = s[n * P + i];
  }
}

// First chunk index of every sequence, checking that the chunks tile each sequence exactly.
std::vector<int64_t> chunk_ranges(const at::Tensor& cu_seqlens, const at::Tensor& cu_chunks,
                                  const at::Tensor& chunk_seq_idx) {
  auto seqs = cu_seqlens.to(at::kLong).contiguous();
  auto bounds = cu_chunks.to(at::kLong).contiguous();
  auto owner = chunk_seq_idx.to(at::kLong).contiguous();
  const int64_t batch = seqs.numel() - 1, nchunks = bounds.numel() - 1;
  const int64_t* S = seqs.data_ptr<int64_t>();
  const int64_t* Bd = bounds.data_ptr<int64_t>();
  const int64_t* O = owner.data_ptr<int64_t>();
  TORCH_CHECK(owner.numel() == nchunks, "ssd_scan_fwd: chunk_seq_idx has ", owner.numel(),
              " entries but cu_chunk_seqlens describes ", nchunks, " chunks");
  std::vector<int64_t> first(batch + 1, 0);
  int64_t c = 0;
  for (int64_t b = 0; b < batch; ++b) {
    first[b] = c;
    int64_t pos = S[b];
    while (pos < S[b + 1]) {
      TORCH_CHECK(c < nchunks && O[c] == b && Bd[c] == pos && Bd[c + 1] > pos &&
                      Bd[c + 1] <= S[b + 1],
                  "ssd_scan_fwd: logical chunks must tile every sequence in order and never "
                  "cross a sequence boundary (sequence ",
                  b, ", token ", pos, ")");
      pos = Bd[++c];
    }
  }
  first[batch] = c;
  TORCH_CHECK(c == nchunks, "ssd_scan_fwd: ", nchunks - c, " chunk(s) lie outside every sequence");
  return first;
}

at::Tensor as_f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

}  // namespace

at::Tensor ssd_scan_fwd(at::Tensor& out, const at::Tensor& x, const at::Tensor& dt,
                        const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                        const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                        const std::optional<at::Tensor>& initial_states,
                        const at::Tensor& cu_seqlens, const at::Tensor& cu_chunk_seqlens,
                        const at::Tensor& chunk_seq_idx) {
  TORCH_CHECK(x.dim() == 3, "ssd_scan_fwd: x must be (tokens, heads, head_dim), got ", x.sizes());
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2);
  TORCH_CHECK(B.dim() == 3 && B.size(0) == T && C.sizes() == B.sizes(),
              "ssd_scan_fwd: B and C must be (tokens, groups, d_state) matching x, got ",
              B.sizes(), " and ", C.sizes());
  const int64_t G = B.size(1), N = B.size(2);
  TORCH_CHECK(G > 0 && H % G == 0, "ssd_scan_fwd: heads (", H, ") not divisible by groups (", G,
              ")");
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == T && dt.size(1) == H,
              "ssd_scan_fwd: dt must be (tokens, heads), got ", dt.sizes());
  TORCH_CHECK(A.numel() == H, "ssd_scan_fwd: A must have one value per head");
  TORCH_CHECK(out.sizes() == x.sizes(), "ssd_scan_fwd: out must have x's shape ", x.sizes());
  TORCH_CHECK(!D.has_value() || D->numel() == H,
              "ssd_scan_fwd: D must have one value per head (a (heads, head_dim) D with "
              "per-element values is not supported)");
  TORCH_CHECK(!z.has_value() || z->sizes() == x.sizes(), "ssd_scan_fwd: z must match x");
  const int64_t batch = cu_seqlens.numel() - 1;
  TORCH_CHECK(batch >= 0, "ssd_scan_fwd: cu_seqlens must have batch + 1 entries");
  TORCH_CHECK(!initial_states.has_value() ||
                  initial_states->sizes() == at::IntArrayRef({batch, H, P, N}),
              "ssd_scan_fwd: initial_states must be (batch, heads, head_dim, d_state)");
  const auto first = chunk_ranges(cu_seqlens, cu_chunk_seqlens, chunk_seq_idx);
  const int64_t nchunks = cu_chunk_seqlens.numel() - 1;

  auto xf = as_f32(x), dtf = as_f32(dt), Af = as_f32(A), Bf = as_f32(B), Cf = as_f32(C);
  at::Tensor Df, zf, initf;
  if (D.has_value()) Df = as_f32(*D);
  if (z.has_value()) zf = as_f32(*z);
  if (initial_states.has_value()) initf = as_f32(*initial_states);
  auto y = at::zeros({T, H, P}, x.options().dtype(at::kFloat));
  auto states = at::empty({nchunks, H, P, N}, x.options().dtype(at::kFloat));
  auto bounds = cu_chunk_seqlens.to(at::kLong).contiguous();

  ScanParams p{H, P, N, H / G, xf.data_ptr<float>(), dtf.data_ptr<float>(), Af.data_ptr<float>(),
               Bf.data_ptr<float>(), Cf.data_ptr<float>(),
               D.has_value() ? Df.data_ptr<float>() : nullptr,
               z.has_value() ? zf.data_ptr<float>() : nullptr,
               initial_states.has_value() ? initf.data_ptr<float>() : nullptr,
               y.data_ptr<float>(), states.data_ptr<float>()};
  const int64_t* cb = bounds.data_ptr<int64_t>();
  at::parallel_for(0, batch * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(P * N), tmp(2 * P);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t seq = job / H, h = job % H;
      scan_one(p, seq, h, cb, first[seq], first[seq + 1], s, tmp);
    }
  });
  out.copy_(y);
  return states;
}

}  // namespace vllm_hybrid
