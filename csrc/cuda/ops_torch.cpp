// Torch glue of the CUDA ops: validates tensors (the same checks and messages as the CPU ops, via
// snapshot_desc.h), turns them into the params structs of snapshot_params.h, uploads descriptor
// tables with one host-to-device copy, launches the kernels of csrc/cuda/*.cu on the current
// stream, and registers everything for the CUDA dispatch key (same schemas as csrc/bindings.cpp).
//
// Includes ATen, c10/cuda (CUDAGuard, CUDAStream) and cuda_runtime_api.h only; no
// ATen/cuda/CUDAContext.h (it needs the cuBLAS/cuSPARSE headers) and no Python.
// Not CUDA-graph capturable: pairs are validated on the host (a device-side `pairs` is copied
// to the host first, which synchronizes).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "snapshot_desc.h"
#include "snapshot_params.h"

namespace vllm_hybrid {
namespace {

// The CUDA device all CUDA tensors are on; CPU tensors must be pinned (mapped into the device's
// address space through unified addressing).
at::Device common_device(std::initializer_list<at::TensorList> lists, const char* op) {
  std::optional<at::Device> device;
  for (auto list : lists)
    for (const auto& t : list) {
      if (t.is_cuda()) {
        TORCH_CHECK(!device || *device == t.device(), op, ": tensors on ", *device, " and ",
                    t.device(), "; use one CUDA device per call");
        device = t.device();
      } else {
        TORCH_CHECK(t.is_cpu() && t.is_pinned(), op, ": a ", t.device(), " tensor ",
                    t.sizes(), " is not pinned; the CUDA op accepts CUDA tensors and pinned "
                    "host tensors only");
      }
    }
  TORCH_CHECK(device.has_value(), op, ": no CUDA tensor among the arguments");
  return *device;
}

void check_launch(int err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// pairs followed by the descriptor table, in one device buffer.
template <typename Desc>
at::Tensor upload(const at::Tensor& pairs, const std::vector<Desc>& descs, at::Device device) {
  const size_t pair_bytes = pairs.numel() * sizeof(int64_t);
  const size_t bytes = pair_bytes + descs.size() * sizeof(Desc);
  auto host = at::empty({static_cast<int64_t>(bytes)},
                        at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr<uint8_t>(), pairs.data_ptr<int64_t>(), pair_bytes);
  std::memcpy(host.data_ptr<uint8_t>() + pair_bytes, descs.data(), descs.size() * sizeof(Desc));
  return host.to(device, /*non_blocking=*/true);
}

void* stream_of(at::Device device) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

void snapshot_copy_cuda(at::TensorList src_tensors, at::TensorList dst_tensors,
                        const at::Tensor& pairs) {
  const char* op = "snapshot_copy";
  const at::Device device = common_device({src_tensors, dst_tensors}, op);
  c10::cuda::CUDAGuard guard(device);
  snapshot::PairCheck check;
  auto descs = snapshot::copy_descs(src_tensors, dst_tensors, check, op);
  check.aliased = snapshot::any_alias(src_tensors, dst_tensors);
  const auto p = snapshot::checked_pairs(pairs, check, op);
  if (p.size(0) == 0 || descs.empty()) return;
  const int64_t tile = snapshot_copy_tile_bytes();
  int64_t tiles = 0;
  for (auto& d : descs) {
    d.tile_begin = tiles;
    tiles += (d.span_bytes + tile - 1) / tile;
  }
  TORCH_CHECK(tiles < (int64_t{1} << 31), op, ": ", tiles, " tiles per pair exceed the grid");
  const auto buf = upload(p, descs, device);
  const auto* base = buf.data_ptr<uint8_t>();
  CopyParams params{reinterpret_cast<const CopyDesc*>(base + p.numel() * sizeof(int64_t)),
                    reinterpret_cast<const int64_t*>(base),
                    static_cast<int64_t>(descs.size()),
                    p.size(0),
                    tile,
                    tiles};
  check_launch(launch_snapshot_copy(params, stream_of(device)), op);
}

void run_int8(at::TensorList states, at::TensorList q_tensors, at::TensorList scales,
              const at::Tensor& pairs, bool save, const char* op) {
  const at::Device device = common_device({states, q_tensors, scales}, op);
  c10::cuda::CUDAGuard guard(device);
  snapshot::PairCheck check;
  auto descs = snapshot::quant_descs(states, q_tensors, scales, !save, check, op);
  const auto p = snapshot::checked_pairs(pairs, check, op);
  if (p.size(0) == 0 || descs.empty()) return;
  int64_t groups = 0;
  for (auto& d : descs) {
    d.group_begin = groups;
    groups += d.groups;
  }
  TORCH_CHECK(groups < (int64_t{1} << 31) * 8, op, ": ", groups, " groups exceed the grid");
  const auto buf = upload(p, descs, device);
  const auto* base = buf.data_ptr<uint8_t>();
  QuantParams params{reinterpret_cast<const QuantDesc*>(base + p.numel() * sizeof(int64_t)),
                     reinterpret_cast<const int64_t*>(base), static_cast<int64_t>(descs.size()),
                     p.size(0), groups};
  void* stream = stream_of(device);
  check_launch(save ? launch_snapshot_quantize_int8(params, stream)
                    : launch_snapshot_dequantize_int8(params, stream),
               op);
}

void snapshot_quantize_int8_cuda(at::TensorList states, at::TensorList q_tensors,
                                 at::TensorList scales, const at::Tensor& pairs) {
  run_int8(states, q_tensors, scales, pairs, /*save=*/true, "snapshot_quantize_int8");
}

void snapshot_dequantize_int8_cuda(at::TensorList q_tensors, at::TensorList scales,
                                   at::TensorList states, const at::Tensor& pairs) {
  run_int8(states, q_tensors, scales, pairs, /*save=*/false, "snapshot_dequantize_int8");
}

// ---------------------------------------------------------------------------------------------
// store_prefill_checkpoint

at::Tensor device_long(const at::Tensor& t, const char* name, int64_t rows, at::Device device) {
  TORCH_CHECK(t.dim() == 1 && t.numel() >= rows, "store_prefill_checkpoint: ", name,
              " must be 1-D with at least ", rows, " entries, got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt,
              "store_prefill_checkpoint: ", name, " must be int32 or int64, got ",
              t.scalar_type());
  return t.to(device, at::kLong).contiguous();
}

void fill_ssm(const at::Tensor& t, int64_t* stride) {
  const int64_t pad = 4 - t.dim();
  stride[0] = t.stride(0);
  for (int64_t k = 1; k < 4; ++k) stride[k] = k < pad + 1 ? 0 : t.stride(k - pad);
}

void store_prefill_checkpoint_cuda(const at::Tensor& x, at::Tensor& conv_state,
                                   const at::Tensor& chunk_states, at::Tensor& ssm_state,
                                   const at::Tensor& query_start_loc,
                                   const at::Tensor& checkpoint_offsets,
                                   const at::Tensor& state_indices, const at::Tensor& chunk_idx,
                                   int64_t state_len) {
  const char* op = "store_prefill_checkpoint";
  TORCH_CHECK(x.dim() == 2, op, ": x must be (dim, tokens), got ", x.sizes());
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == x.size(0), op,
              ": conv_state must be (blocks, dim, width) with dim = ", x.size(0), ", got ",
              conv_state.sizes());
  TORCH_CHECK(state_len > 0 && state_len <= conv_state.size(2), op, ": state_len ", state_len,
              " must be in [1, ", conv_state.size(2), "]");
  TORCH_CHECK(ssm_state.dim() >= 2 && ssm_state.dim() <= 4 &&
                  chunk_states.dim() == ssm_state.dim() &&
                  chunk_states.sizes().slice(1) == ssm_state.sizes().slice(1),
              op, ": chunk_states ", chunk_states.sizes(), " and ssm_state ", ssm_state.sizes(),
              " must agree past their first dimension (at most 3 dims per block on CUDA)");
  const at::Device device = x.device();
  for (const at::Tensor* t : {&std::as_const(conv_state), &chunk_states, &std::as_const(ssm_state)})
    TORCH_CHECK(t->device() == device, op, ": x is on ", device, " but another state is on ",
                t->device());
  const int64_t rows = checkpoint_offsets.numel();
  TORCH_CHECK(rows < 65536, op, ": at most 65535 rows per call on CUDA, got ", rows);
  c10::cuda::CUDAGuard guard(device);
  const auto off = device_long(checkpoint_offsets, "checkpoint_offsets", rows, device);
  const auto dst = device_long(state_indices, "state_indices", rows, device);
  const auto src = device_long(chunk_idx, "chunk_idx", rows, device);
  const auto starts = device_long(query_start_loc, "query_start_loc", rows + 1, device);

  PrefillCheckpointParams p{};
  p.x = static_cast<const char*>(x.data_ptr());
  p.x_dtype = snapshot::state_dtype(x, op, "x");
  p.x_stride_dim = x.stride(0), p.x_stride_tok = x.stride(1);
  p.conv = static_cast<char*>(conv_state.data_ptr());
  p.conv_dtype = snapshot::state_dtype(conv_state, op, "conv_state");
  p.conv_stride_block = conv_state.stride(0), p.conv_stride_dim = conv_state.stride(1);
  p.conv_stride_col = conv_state.stride(2);
  p.chunks = static_cast<const char*>(chunk_states.data_ptr());
  p.chunks_dtype = snapshot::state_dtype(chunk_states, op, "chunk_states");
  fill_ssm(chunk_states, p.chunks_stride);
  p.ssm = static_cast<char*>(ssm_state.data_ptr());
  p.ssm_dtype = snapshot::state_dtype(ssm_state, op, "ssm_state");
  fill_ssm(ssm_state, p.ssm_stride);
  const int64_t pad = 4 - ssm_state.dim();
  for (int64_t k = 0; k < 3; ++k) p.inner[k] = k < pad ? 1 : ssm_state.size(k + 1 - pad);
  p.dim = x.size(0), p.state_len = state_len, p.rows = rows;
  p.conv_blocks = conv_state.size(0), p.ssm_blocks = ssm_state.size(0);
  p.num_chunks = chunk_states.size(0);
  p.query_start_loc = starts.data_ptr<int64_t>();
  p.checkpoint_offsets = off.data_ptr<int64_t>();
  p.state_indices = dst.data_ptr<int64_t>();
  p.chunk_idx = src.data_ptr<int64_t>();
  // Index values live on the device: out-of-range rows are skipped by the kernel. With
  // VLLM_HYBRID_CHECK_INDICES=1 they are also reported here (costs a synchronization).
  const char* env = std::getenv("VLLM_HYBRID_CHECK_INDICES");
  const bool check = env != nullptr && std::strcmp(env, "1") == 0;
  at::Tensor flag;
  if (check) {
    flag = at::zeros({1}, x.options().dtype(at::kInt));
    p.error_flag = flag.data_ptr<int32_t>();
  }
  check_launch(launch_store_prefill_checkpoint(p, stream_of(device)), op);
  if (check)
    TORCH_CHECK(flag.item<int32_t>() == 0, op, ": some row's checkpoint offset, destination "
                "block or chunk index is out of range (the row was skipped)");
}

}  // namespace
}  // namespace vllm_hybrid

TORCH_LIBRARY_IMPL(vllm_hybrid, CUDA, m) {
  m.impl("snapshot_copy", &vllm_hybrid::snapshot_copy_cuda);
  m.impl("snapshot_quantize_int8", &vllm_hybrid::snapshot_quantize_int8_cuda);
  m.impl("snapshot_dequantize_int8", &vllm_hybrid::snapshot_dequantize_int8_cuda);
  m.impl("store_prefill_checkpoint", &vllm_hybrid::store_prefill_checkpoint_cuda);
}
