// pagedwindow: the prep's launch parameter block, PwPrepareLaunch (host code, no CUDA types). The launcher
// pw_prepare_qkv (prepare_qkv.cu) reads it; the compiled call gate (launch_gate.cpp) fills its per-call fields;
// src/pagedwindow/cuda/ops.py mirrors it as a ctypes.Structure and checks sizeof against pw_prepare_launch_size().
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
