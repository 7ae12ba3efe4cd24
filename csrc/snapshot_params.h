// Plain parameter structs shared by the CPU ops (csrc/cpu/snapshot*.cpp), the torch glue of the
// CUDA ops (csrc/cuda/*_torch.cpp) and the CUDA kernels (csrc/cuda/*.cu).
//
// This header includes nothing from torch or CUDA, so the kernel files compile with nvcc alone
// (tests/ops/test_cuda_compile.py). Pointers are raw; strides are in elements unless the name
// says bytes. The structs are trivially copyable: the CUDA glue packs the descriptor tables and
// the (src, dst) pairs into one byte buffer and uploads it with a single host-to-device copy.
#pragma once

#include <cstdint>

namespace vllm_hybrid {

// Element types of state tensors the quantize / checkpoint kernels read and write.
enum StateDType : int32_t { kStateF32 = 0, kStateF16 = 1, kStateBF16 = 2 };

// ---------------------------------------------------------------------------------------------
// snapshot_copy: byte copy of whole blocks. One descriptor per state tensor (one layer's conv or
// SSM state). Block b of a tensor is the dense byte span [base + b * block_bytes, + span_bytes).
struct CopyDesc {
  const char* src;          // block 0 of the source tensor
  char* dst;                // block 0 of the destination tensor
  int64_t src_block_bytes;  // source block stride, bytes (>= span_bytes)
  int64_t dst_block_bytes;  // destination block stride, bytes (>= span_bytes)
  int64_t span_bytes;       // bytes of one block's state (dense, same layout in src and dst)
  int64_t tile_begin;       // CUDA: first global tile of this tensor (prefix sum over tensors)
  int64_t vec_bytes;        // 16, 8, 4, 2 or 1: divides both bases, both strides and the span
};

struct CopyParams {
  const CopyDesc* descs;  // num_descs descriptors
  const int64_t* pairs;   // (num_pairs, 2) row-major: source block, destination block
  int64_t num_descs;
  int64_t num_pairs;
  int64_t tile_bytes;   // CUDA: bytes per thread block (a multiple of 16)
  int64_t total_tiles;  // CUDA: tiles over all descriptors for one pair
};

// ---------------------------------------------------------------------------------------------
// snapshot_quantize_int8 / snapshot_dequantize_int8. A state tensor is (blocks, G, *rest); rest
// coalesces to E elements with one stride. Group g of block b (one head of an SSM state, one
// channel of a conv state) holds E elements and has one fp32 scale.
struct QuantDesc {
  char* x;     // float state: the source on save, the destination on restore
  int8_t* q;   // int8 pool
  float* scale;  // fp32 scales, (blocks, G)
  int64_t x_block, x_group, x_elem;  // element strides of x
  int64_t q_block, q_group, q_elem;  // element strides of q
  int64_t s_block, s_group;          // element strides of scale
  int64_t groups;       // G
  int64_t group_elems;  // E
  int64_t group_begin;  // CUDA: first global group of this tensor (prefix sum over tensors)
  int64_t dtype;        // StateDType of x
};

struct QuantParams {
  const QuantDesc* descs;
  const int64_t* pairs;  // (num_pairs, 2): source block, destination block
  int64_t num_descs;
  int64_t num_pairs;
  int64_t total_groups;  // groups over all descriptors for one pair
};

// ---------------------------------------------------------------------------------------------
// store_prefill_checkpoint on CUDA (same contract as csrc/cpu/prefill_checkpoint.cpp). The SSM
// state's per-block shape is padded to 3 dims (sizes 1 in front).
struct PrefillCheckpointParams {
  const char* x;  // (dim, tokens)
  int64_t x_dtype, x_stride_dim, x_stride_tok;
  char* conv;  // (blocks, dim, width)
  int64_t conv_dtype, conv_stride_block, conv_stride_dim, conv_stride_col;
  const char* chunks;  // (nchunks, S0, S1, S2)
  int64_t chunks_dtype, chunks_stride[4];
  char* ssm;  // (blocks, S0, S1, S2)
  int64_t ssm_dtype, ssm_stride[4];
  int64_t inner[3];  // S0, S1, S2
  int64_t dim, state_len, rows, conv_blocks, ssm_blocks, num_chunks;
  const int64_t* query_start_loc;     // (rows + 1,)
  const int64_t* checkpoint_offsets;  // (rows,)
  const int64_t* state_indices;       // (rows,)
  const int64_t* chunk_idx;           // (rows,)
  int32_t* error_flag;  // set to 1 when a row's indices are out of range (row skipped); or null
};

// CUDA launchers (csrc/cuda/*.cu). `params` and every pointer inside must be device-accessible
// except `params` itself (passed by value); `stream` is a cudaStream_t. Return a cudaError_t.
int64_t snapshot_copy_tile_bytes();  // bytes per thread block of the copy kernel
int launch_snapshot_copy(const CopyParams& params, void* stream);
int launch_snapshot_quantize_int8(const QuantParams& params, void* stream);
int launch_snapshot_dequantize_int8(const QuantParams& params, void* stream);
int launch_store_prefill_checkpoint(const PrefillCheckpointParams& params, void* stream);

}  // namespace vllm_hybrid
