// Fused batched snapshot save / restore on CPU: for every (source block, destination block) pair
// copy the state of every listed tensor (the conv and SSM state of every recurrent layer) in one
// call. CPU twin of csrc/cuda/snapshot_copy.cu.
//
// Work items are (pair, tensor, chunk of at most kChunkBytes) and run in one parallel loop, so a
// batch of a few pairs over ~100 tensors of very different sizes still spreads evenly over the
// threads; each item is one memcpy of a dense span (the validation in snapshot_desc.h guarantees
// that a block is a dense byte span with the same layout on both sides).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops.h"
#include "snapshot_desc.h"

namespace vllm_hybrid {
namespace {

constexpr int64_t kChunkBytes = 256 << 10;

void check_cpu(at::TensorList tensors, const char* list) {
  for (size_t i = 0; i < tensors.size(); ++i)
    TORCH_CHECK(tensors[i].device().is_cpu(), "snapshot_copy: ", snapshot::tname(list, i),
                " is on ", tensors[i].device(), "; the CPU op needs every tensor on the CPU");
}

}  // namespace

void snapshot_copy(at::TensorList src_tensors, at::TensorList dst_tensors,
                   const at::Tensor& pairs) {
  const char* op = "snapshot_copy";
  check_cpu(src_tensors, "src_tensors");
  check_cpu(dst_tensors, "dst_tensors");
  snapshot::PairCheck check;
  const auto descs = snapshot::copy_descs(src_tensors, dst_tensors, check, op);
  check.aliased = snapshot::any_alias(src_tensors, dst_tensors);
  const auto p = snapshot::checked_pairs(pairs, check, op);
  const int64_t n = p.size(0);
  if (n == 0 || descs.empty()) return;

  // chunk_begin[t]: first chunk of tensor t within one pair
  std::vector<int64_t> chunk_begin(descs.size() + 1, 0);
  for (size_t t = 0; t < descs.size(); ++t)
    chunk_begin[t + 1] = chunk_begin[t] + (descs[t].span_bytes + kChunkBytes - 1) / kChunkBytes;
  const int64_t per_pair = chunk_begin.back();
  const int64_t* pr = p.data_ptr<int64_t>();
  at::parallel_for(0, n * per_pair, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / per_pair, chunk = item % per_pair;
      const size_t t =
          std::upper_bound(chunk_begin.begin(), chunk_begin.end(), chunk) - chunk_begin.begin() - 1;
      const CopyDesc& d = descs[t];
      const int64_t offset = (chunk - chunk_begin[t]) * kChunkBytes;
      const int64_t bytes = std::min(kChunkBytes, d.span_bytes - offset);
      std::memcpy(d.dst + pr[2 * pair + 1] * d.dst_block_bytes + offset,
                  d.src + pr[2 * pair] * d.src_block_bytes + offset, bytes);
    }
  });
}

}  // namespace vllm_hybrid
