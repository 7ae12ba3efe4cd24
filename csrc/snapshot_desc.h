// Host-side validation shared by the CPU and CUDA snapshot ops: turns lists of per-layer state
// tensors into the descriptor tables of snapshot_params.h, with a TORCH_CHECK and a message on
// every precondition. Both backends call these, so they reject the same inputs with the same
// messages.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "snapshot_params.h"

namespace vllm_hybrid::snapshot {

inline std::string tname(const char* list, size_t i) {
  return std::string(list) + "[" + std::to_string(i) + "]";
}

inline StateDType state_dtype(const at::Tensor& t, const char* op, const std::string& name) {
  switch (t.scalar_type()) {
    case at::kFloat: return kStateF32;
    case at::kHalf: return kStateF16;
    case at::kBFloat16: return kStateBF16;
    default:
      break;
  }
  TORCH_CHECK(false, op, ": ", name, " must be float32, float16 or bfloat16, got ",
              t.scalar_type());
  return kStateF32;
}

// Elements of one block when the dims past the first tile a dense span in some order (any
// permutation of a contiguous layout: vLLM's padded page views and transposed conv views).
inline int64_t dense_block_elems(const at::Tensor& t, const char* op, const std::string& name) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims with size > 1
  int64_t elems = 1;
  for (int64_t d = 1; d < t.dim(); ++d) {
    if (t.size(d) != 1) dims.emplace_back(t.stride(d), t.size(d));
    elems *= t.size(d);
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    TORCH_CHECK(stride == expected, op, ": ", name, " ", t.sizes(), " with strides ",
                t.strides(), " must be dense within a block (its dims past the first must tile "
                "a contiguous span in some order)");
    expected *= size;
  }
  TORCH_CHECK(t.size(0) <= 1 || t.stride(0) >= elems, op, ": ", name, " block stride ",
              t.stride(0), " must be >= the ", elems, " elements of a block (blocks must not "
              "overlap)");
  return elems;
}

// The dims past the second as one strided run: (elements, stride).
inline std::pair<int64_t, int64_t> coalesce_rest(const at::Tensor& t, const char* op,
                                                 const std::string& name) {
  int64_t elems = 1, stride = 1, next = -1;  // next: required stride of the next outer dim
  for (int64_t d = t.dim() - 1; d >= 2; --d) {
    if (t.size(d) == 1) continue;
    if (next < 0) {
      stride = t.stride(d);
    } else {
      TORCH_CHECK(t.stride(d) == next, op, ": ", name, " ", t.sizes(), " with strides ",
                  t.strides(), ": its dims past the second must form one strided run "
                  "(e.g. a contiguous (head_dim, d_state))");
    }
    elems *= t.size(d);
    next = t.stride(d) * t.size(d);
  }
  return {elems, stride};
}

struct PairCheck {
  int64_t src_blocks = INT64_MAX;  // smallest first dim over the source tensors
  int64_t dst_blocks = INT64_MAX;  // smallest first dim over the destination tensors
  bool aliased = false;            // some source tensor shares storage with a destination
};

// Validated (n, 2) int64 contiguous CPU copy of `pairs`: sources and destinations in range, no
// destination twice, and no block both read and written when sources and destinations alias.
inline at::Tensor checked_pairs(const at::Tensor& pairs, const PairCheck& c, const char* op) {
  TORCH_CHECK(pairs.dim() == 2 && pairs.size(1) == 2, op, ": pairs must be (n, 2), got ",
              pairs.sizes());
  TORCH_CHECK(pairs.scalar_type() == at::kLong || pairs.scalar_type() == at::kInt, op,
              ": pairs must be int64 or int32, got ", pairs.scalar_type());
  auto p = pairs.to(at::kCPU, at::kLong).contiguous();
  const int64_t* v = p.data_ptr<int64_t>();
  std::unordered_map<int64_t, int64_t> dst_row;
  std::set<int64_t> srcs;
  for (int64_t i = 0; i < p.size(0); ++i) {
    const int64_t s = v[2 * i], d = v[2 * i + 1];
    TORCH_CHECK(s >= 0 && s < c.src_blocks, op, ": pairs[", i, "] source block ", s,
                " out of range [0, ", c.src_blocks, ")");
    TORCH_CHECK(d >= 0 && d < c.dst_blocks, op, ": pairs[", i, "] destination block ", d,
                " out of range [0, ", c.dst_blocks, ")");
    auto [it, fresh] = dst_row.emplace(d, i);
    TORCH_CHECK(fresh, op, ": destination block ", d, " appears twice (pairs rows ", it->second,
                " and ", i, "); each destination may be written once per call");
    srcs.insert(s);
  }
  if (c.aliased) {
    for (const auto& [d, i] : dst_row)
      TORCH_CHECK(srcs.count(d) == 0, op, ": block ", d, " is written (pairs row ", i,
                  ") and also read in the same call while sources and destinations share "
                  "memory; split the call");
  }
  return p;
}

inline bool any_alias(at::TensorList a, at::TensorList b) {
  std::set<const void*> storages;
  for (const auto& t : a) storages.insert(t.storage().unsafeGetStorageImpl());
  for (const auto& t : b)
    if (storages.count(t.storage().unsafeGetStorageImpl())) return true;
  return false;
}

inline int64_t vec_bytes(std::initializer_list<int64_t> values) {
  for (int64_t v : {16, 8, 4, 2}) {
    bool ok = true;
    for (int64_t x : values) ok = ok && x % v == 0;
    if (ok) return v;
  }
  return 1;
}

// One CopyDesc per tensor pair src[i] -> dst[i]; fills `check` with the block counts.
inline std::vector<CopyDesc> copy_descs(at::TensorList src, at::TensorList dst, PairCheck& check,
                                        const char* op) {
  TORCH_CHECK(src.size() == dst.size(), op, ": src_tensors has ", src.size(),
              " tensors but dst_tensors has ", dst.size());
  std::vector<CopyDesc> descs;
  for (size_t i = 0; i < src.size(); ++i) {
    const at::Tensor &s = src[i], &d = dst[i];
    TORCH_CHECK(s.dim() >= 1 && d.dim() == s.dim() && s.sizes().slice(1) == d.sizes().slice(1),
                op, ": ", tname("src_tensors", i), " ", s.sizes(), " and ",
                tname("dst_tensors", i), " ", d.sizes(), " must agree past their first (block) "
                "dimension");
    TORCH_CHECK(s.scalar_type() == d.scalar_type(), op, ": ", tname("src_tensors", i), " is ",
                s.scalar_type(), " but ", tname("dst_tensors", i), " is ", d.scalar_type());
    for (int64_t k = 1; k < s.dim(); ++k)
      TORCH_CHECK(s.size(k) == 1 || s.stride(k) == d.stride(k), op, ": ",
                  tname("src_tensors", i), " strides ", s.strides(), " and ",
                  tname("dst_tensors", i), " strides ", d.strides(),
                  " must agree within a block (a snapshot is a byte copy)");
    const int64_t elems = dense_block_elems(s, op, tname("src_tensors", i));
    dense_block_elems(d, op, tname("dst_tensors", i));
    check.src_blocks = std::min(check.src_blocks, s.size(0));
    check.dst_blocks = std::min(check.dst_blocks, d.size(0));
    const int64_t es = s.element_size();
    // The span starts at the smallest address of a block (negative strides are not allowed).
    for (int64_t k = 0; k < s.dim(); ++k)
      TORCH_CHECK(s.stride(k) >= 0 && d.stride(k) >= 0, op, ": ", tname("src_tensors", i),
                  " / ", tname("dst_tensors", i), " must have non-negative strides");
    CopyDesc c{};
    c.src = static_cast<const char*>(s.data_ptr());
    c.dst = static_cast<char*>(d.data_ptr());
    c.src_block_bytes = s.stride(0) * es;
    c.dst_block_bytes = d.stride(0) * es;
    c.span_bytes = elems * es;
    c.vec_bytes = vec_bytes({reinterpret_cast<int64_t>(c.src), reinterpret_cast<int64_t>(c.dst),
                             c.src_block_bytes, c.dst_block_bytes, c.span_bytes});
    if (c.span_bytes > 0) descs.push_back(c);
  }
  return descs;
}

// One QuantDesc per tensor: x[i] (float state, (blocks, G, *rest)), q[i] (int8, same shape past
// the first dim), scales[i] (fp32, (blocks, G)). `x_written` says whether x is the destination
// (restore) or q and scales are (save); the written side must be dense within a block.
inline std::vector<QuantDesc> quant_descs(at::TensorList x, at::TensorList q,
                                          at::TensorList scales, bool x_written,
                                          PairCheck& check, const char* op) {
  TORCH_CHECK(x.size() == q.size() && q.size() == scales.size(), op, ": got ", x.size(),
              " state tensors, ", q.size(), " int8 tensors and ", scales.size(),
              " scale tensors; they must pair up one to one");
  std::vector<QuantDesc> descs;
  int64_t& x_blocks = x_written ? check.dst_blocks : check.src_blocks;
  int64_t& q_blocks = x_written ? check.src_blocks : check.dst_blocks;
  for (size_t i = 0; i < x.size(); ++i) {
    const at::Tensor &xt = x[i], &qt = q[i], &st = scales[i];
    const std::string xn = tname("states", i), qn = tname("q_tensors", i),
                      sn = tname("scales", i);
    TORCH_CHECK(xt.dim() >= 2, op, ": ", xn, " must be (blocks, groups, ...), got ",
                xt.sizes());
    const StateDType dt = state_dtype(xt, op, xn);
    TORCH_CHECK(qt.scalar_type() == at::kChar, op, ": ", qn, " must be int8, got ",
                qt.scalar_type());
    TORCH_CHECK(qt.dim() == xt.dim() && qt.sizes().slice(1) == xt.sizes().slice(1), op, ": ",
                qn, " ", qt.sizes(), " must match ", xn, " ", xt.sizes(),
                " past the first dimension");
    TORCH_CHECK(st.scalar_type() == at::kFloat && st.dim() == 2 && st.size(1) == xt.size(1),
                op, ": ", sn, " must be float32 (blocks, ", xt.size(1), "), got ",
                st.scalar_type(), " ", st.sizes());
    TORCH_CHECK(!xt.is_alias_of(qt) && !xt.is_alias_of(st) && !qt.is_alias_of(st), op,
                ": ", xn, ", ", qn, " and ", sn, " must not share memory");
    if (x_written) {
      dense_block_elems(xt, op, xn);
    } else {
      dense_block_elems(qt, op, qn);
      TORCH_CHECK((st.size(1) <= 1 || st.stride(1) == 1) &&
                      (st.size(0) <= 1 || st.stride(0) >= st.size(1)),
                  op, ": ", sn, " must be contiguous within a block, got strides ",
                  st.strides());
    }
    for (const at::Tensor* t : {&xt, &qt, &st})
      for (int64_t k = 0; k < t->dim(); ++k)
        TORCH_CHECK(t->stride(k) >= 0, op, ": ", xn, " / ", qn, " / ", sn,
                    " must have non-negative strides");
    const auto [xe, x_elem] = coalesce_rest(xt, op, xn);
    const auto [qe, q_elem] = coalesce_rest(qt, op, qn);
    x_blocks = std::min(x_blocks, xt.size(0));
    q_blocks = std::min({q_blocks, qt.size(0), st.size(0)});
    QuantDesc d{};
    d.x = static_cast<char*>(xt.data_ptr());
    d.q = qt.data_ptr<int8_t>();
    d.scale = st.data_ptr<float>();
    d.x_block = xt.stride(0), d.x_group = xt.stride(1), d.x_elem = x_elem;
    d.q_block = qt.stride(0), d.q_group = qt.stride(1), d.q_elem = q_elem;
    d.s_block = st.stride(0), d.s_group = st.stride(1);
    d.groups = xt.size(1);
    d.group_elems = xe;
    d.dtype = dt;
    (void)qe;
    if (d.groups > 0 && d.group_elems > 0) descs.push_back(d);
  }
  return descs;
}

}  // namespace vllm_hybrid::snapshot
