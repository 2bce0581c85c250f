// pagedwindow: the launchers' parameter blocks (host code, no CUDA types): PwPrefillLaunch (both prefill
// launchers and the decode kernel, prefill_launch.cuh), PwAppendLaunch (append_paged_kv.cu) and PwPrepareLaunch
// (prepare_qkv.cu). The compiled call gate (launch_gate.cpp) fills their per-call fields; src/pagedwindow/cuda/ops.py
// mirrors each as a ctypes.Structure and checks sizeof against the library's pw_*_launch_size().
// Pointers are device addresses; offsets and strides in elements.
#pragma once

namespace pw_prepare {
constexpr int kMaxHalf = 256;  // inverse frequencies carried in the launch block: head_dim up to 512
}

struct PwPrepareLaunch {
  const void* q;         // [rows, num_qo_heads, head_dim], the projection before the norm
  const void* k;         // [rows, num_kv_heads, head_dim]
  const void* v;         // [rows, num_kv_heads, head_dim]
  void* q_out;           // [rows, num_qo_heads, head_dim], the normed, rotated q
  void* pool;            // the paged KV pool (same dtype)
  const void* q_weight;  // [head_dim], the tensors' dtype or fp32
  const void* k_weight;  // [head_dim]
  long long k_offset;
  long long v_offset;
  long long page_stride;
  const int* page_indices;  // plan arrays (int32, device)
  const int* page_indptr;
  const int* last_page_len;
  const int* qo_indptr;
  const int* plan_scalars;  // {batch_size, total_tokens, num_tiles}
  int page_size;
  int num_qo_heads;
  int num_kv_heads;
  int head_dim;        // 64, 128, 256 or 512
  int dtype;           // 0 bf16, 1 fp16, 2 fp32
  int weight_fp32;     // 1: the norm weights are fp32; 0: the tensors' dtype
  int norm_style;      // 0 gemma4, 1 gemma3
  int batch_capacity;  // the plan's capacities (the live sizes are read from plan_scalars)
  int token_capacity;
  float eps;
  float inv_freq[pw_prepare::kMaxHalf];  // RoPE's inverse frequencies; the first head_dim / 2 are read
};

// The launch parameter block: what the host passes to either prefill launcher, in one struct (mirrored field by
// field by a ctypes.Structure in src/pagedwindow/cuda/ops.py; pw_prefill_launch_size() lets the host check
// the two agree). Pointers are device addresses; offsets and strides are in elements.
struct PwPrefillLaunch {
  const void* q;            // [rows, num_qo_heads, 256] bf16
  void* out;                // [rows, num_qo_heads, 256] bf16
  float* lse;               // [rows, num_qo_heads] fp32, or NULL
  const void* pool;         // the paged KV pool (bf16)
  long long k_offset;       // the layer's K block within a page
  long long v_offset;       // the layer's V block within a page
  long long page_stride;    // elements of one page
  const int* page_indices;  // plan arrays (int32, device)
  const int* page_indptr;
  const int* last_page_len;
  const int* qo_indptr;
  const int* request_indices;
  const int* qo_tile_indices;
  const int* plan_scalars;  // {batch_size, total_tokens, num_tiles}
  int page_size;
  int num_qo_heads;
  int num_kv_heads;
  int grid_tiles;   // grid x: the plan's tile capacity (the live count is read from plan_scalars)
  int cta_tile_q;   // 16, 64 or 128
  int window_left;  // inclusive distance, -1 = no window
  float sm_scale;
  // cta_tile_q 16 runs the split-KV decode kernel (decode_hd256.cu), which may split a tile's keys across CTAs:
  // each split leaves its partial output rows and log-sum-exp here and the last one to finish merges them.
  float* workspace;     // [workspace_units, 16 rows, 256 + 1] fp32 scratch, or NULL when workspace_units is 0
  int* split_counters;  // [workspace_units] int32, all zero before a launch (every launch leaves them zero)
  int workspace_units;  // 0: tiles are never split (the other tiles ignore all three fields)
  // The host's bound on any live tile's splits at this plan update (0: none given). An eager decode launch skips
  // the merge grid when it is at most kGridMergeMaxSplits (decode_hd256.cu); a launch under stream capture
  // keeps the capacity's rule, since its graph replays after later updates.
  int max_tile_splits;
};

// The launch parameter block (mirrored by a ctypes.Structure in src/pagedwindow/cuda/ops.py; the host checks
// sizeof against pw_append_launch_size()). Pointers are device addresses; offsets and strides in elements.
struct PwAppendLaunch {
  const void* k;  // [rows, num_kv_heads, head_dim]
  const void* v;  // [rows, num_kv_heads, head_dim]
  void* pool;     // the paged KV pool (same dtype)
  long long k_offset;
  long long v_offset;
  long long page_stride;
  const int* page_indices;  // plan arrays (int32, device)
  const int* page_indptr;
  const int* last_page_len;
  const int* qo_indptr;
  const int* plan_scalars;  // {batch_size, total_tokens, num_tiles}
  int page_size;
  int num_kv_heads;
  int head_dim;
  int elem_bytes;      // 2 (bf16/fp16) or 4 (fp32)
  int batch_capacity;  // the plan's capacities (the live sizes are read from plan_scalars)
  int token_capacity;
};
