// pagedwindow: what the head_dim-256 attention launchers share (prefill_hd256.cu, prefill_hd256_sm90.cu, and
// decode_hd256.cu, which both run for cta_tile_q 16): the status codes, the kernel parameter block, and the
// argument checks every launch passes first.
// Host-side only; the kernels read PwPrefillParams by value.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "launch_blocks.cuh"  // PwPrefillLaunch, the launch block

// Negative: an argument error found before any launch (nothing is written); positive: a cudaError_t.
enum PwPrefillStatus {
  PW_PREFILL_OK = 0,
  PW_PREFILL_ERR_NULL_POINTER = -1,       // a required pointer is NULL (lse may be NULL; the workspace when it has
                                          // no units)
  PW_PREFILL_ERR_NONPOSITIVE_SIZE = -2,   // page_size, num_qo_heads, num_kv_heads, page_stride < 1, grid_tiles < 0,
                                          // workspace_units < 0 or max_tile_splits < 0
  PW_PREFILL_ERR_HEAD_RATIO = -3,         // num_qo_heads % num_kv_heads != 0
  PW_PREFILL_ERR_UNSUPPORTED_TILE = -4,   // cta_tile_q not in {16, 64, 128}
  PW_PREFILL_ERR_MISALIGNED = -5,         // q/out/pool/workspace not 16-byte aligned, lse/split_counters not
                                          // 4-byte aligned, or k_offset/v_offset/page_stride not a multiple of 8
  PW_PREFILL_ERR_BAD_SCALE = -6,          // sm_scale not finite or not > 0
  PW_PREFILL_ERR_BAD_WINDOW = -7,         // window_left < -1
  PW_PREFILL_ERR_NEGATIVE_OFFSET = -9,    // k_offset or v_offset < 0
  PW_PREFILL_ERR_SMEM_UNAVAILABLE = -10,  // the device cannot give this tile the shared memory it needs
  PW_PREFILL_ERR_TOO_LARGE = -11,         // num_kv_heads > 65535 (grid y) or num_qo_heads * 256 past int32
  PW_PREFILL_ERR_NOT_SM90 = -12,          // (sm_90 launcher) library not built for sm_90a, or device not 9.0
};

constexpr int kPwPrefillHeadDim = 256;

struct PwPrefillParams {
  const __nv_bfloat16* q;
  __nv_bfloat16* out;
  float* lse;
  const __nv_bfloat16* pool;
  long long k_offset;
  long long v_offset;
  long long page_stride;
  const int* page_indices;
  const int* page_indptr;
  const int* last_page_len;
  const int* qo_indptr;
  const int* request_indices;
  const int* qo_tile_indices;
  const int* plan_scalars;
  int page_size;
  int num_qo_heads;
  int num_kv_heads;
  int group;
  int window_left;
  float scale_log2;  // sm_scale * log2(e)
  float* workspace;  // the decode kernel's split partials (see PwPrefillLaunch)
  int* split_counters;
  int workspace_units;
};


// Check a launch's arguments and fill `p`; returns a status (PW_PREFILL_OK or < 0). Nothing is launched.
static inline int pw_prefill_prepare(const PwPrefillLaunch* a, PwPrefillParams* p) {
  if (a == nullptr) return PW_PREFILL_ERR_NULL_POINTER;
  if (a->q == nullptr || a->out == nullptr || a->pool == nullptr || a->page_indices == nullptr ||
      a->page_indptr == nullptr || a->last_page_len == nullptr || a->qo_indptr == nullptr ||
      a->request_indices == nullptr || a->qo_tile_indices == nullptr || a->plan_scalars == nullptr)
    return PW_PREFILL_ERR_NULL_POINTER;
  if (a->page_size < 1 || a->num_qo_heads < 1 || a->num_kv_heads < 1 || a->page_stride < 1 || a->grid_tiles < 0 ||
      a->workspace_units < 0 || a->max_tile_splits < 0)
    return PW_PREFILL_ERR_NONPOSITIVE_SIZE;
  if (a->workspace_units > 0 && (a->workspace == nullptr || a->split_counters == nullptr))
    return PW_PREFILL_ERR_NULL_POINTER;
  if (a->k_offset < 0 || a->v_offset < 0) return PW_PREFILL_ERR_NEGATIVE_OFFSET;
  if (a->num_qo_heads % a->num_kv_heads != 0) return PW_PREFILL_ERR_HEAD_RATIO;
  if (a->num_kv_heads > 65535 || a->num_qo_heads > (0x7fffffff / kPwPrefillHeadDim)) return PW_PREFILL_ERR_TOO_LARGE;
  if (!(a->sm_scale > 0.f) || !isfinite(a->sm_scale)) return PW_PREFILL_ERR_BAD_SCALE;
  if (a->window_left < -1) return PW_PREFILL_ERR_BAD_WINDOW;
  // clang-format off: the alignment masks grouped by the bound they are tested against
  if (((reinterpret_cast<uintptr_t>(a->q) | reinterpret_cast<uintptr_t>(a->out) |
        reinterpret_cast<uintptr_t>(a->pool) | reinterpret_cast<uintptr_t>(a->workspace)) & 15u) != 0 ||
      ((reinterpret_cast<uintptr_t>(a->lse) | reinterpret_cast<uintptr_t>(a->split_counters)) & 3u) != 0 ||
      ((a->k_offset | a->v_offset | a->page_stride) & 7) != 0)
    return PW_PREFILL_ERR_MISALIGNED;
  // clang-format on
  if (a->cta_tile_q != 16 && a->cta_tile_q != 64 && a->cta_tile_q != 128) return PW_PREFILL_ERR_UNSUPPORTED_TILE;

  p->q = static_cast<const __nv_bfloat16*>(a->q);
  p->out = static_cast<__nv_bfloat16*>(a->out);
  p->lse = a->lse;
  p->pool = static_cast<const __nv_bfloat16*>(a->pool);
  p->k_offset = a->k_offset;
  p->v_offset = a->v_offset;
  p->page_stride = a->page_stride;
  p->page_indices = a->page_indices;
  p->page_indptr = a->page_indptr;
  p->last_page_len = a->last_page_len;
  p->qo_indptr = a->qo_indptr;
  p->request_indices = a->request_indices;
  p->qo_tile_indices = a->qo_tile_indices;
  p->plan_scalars = a->plan_scalars;
  p->page_size = a->page_size;
  p->num_qo_heads = a->num_qo_heads;
  p->num_kv_heads = a->num_kv_heads;
  p->group = a->num_qo_heads / a->num_kv_heads;
  p->window_left = a->window_left;
  p->scale_log2 = a->sm_scale * 1.4426950408889634f;
  p->workspace = a->workspace;
  p->split_counters = a->split_counters;
  p->workspace_units = a->workspace_units;
  return PW_PREFILL_OK;
}

// Launch the split-KV decode kernel (decode_hd256.cu) for a block pw_prefill_prepare checked, with cta_tile_q 16,
// on the current device (max_tile_splits: the block's); returns 0, a negative status or a cudaError_t. Both
// prefill launchers call it for 16.
int pw_decode_hd256_launch(const PwPrefillParams& p, int grid_tiles, int max_tile_splits, cudaStream_t stream);

// Human-readable text of a status returned by either prefill launcher.
static inline const char* pw_prefill_status_string(int code) {
  switch (code) {
    case PW_PREFILL_OK: return "ok";
    case PW_PREFILL_ERR_NULL_POINTER: return "a required pointer is NULL";
    case PW_PREFILL_ERR_NONPOSITIVE_SIZE:
      return "page_size, num_qo_heads, num_kv_heads or page_stride < 1, or grid_tiles, workspace_units or "
             "max_tile_splits < 0";
    case PW_PREFILL_ERR_HEAD_RATIO: return "num_qo_heads is not a multiple of num_kv_heads";
    case PW_PREFILL_ERR_UNSUPPORTED_TILE: return "cta_tile_q is not 16, 64 or 128";
    case PW_PREFILL_ERR_MISALIGNED:
      return "q/out/pool/workspace not 16-byte aligned, lse/split_counters not 4-byte aligned, or an offset/stride "
             "not a multiple of 8";
    case PW_PREFILL_ERR_BAD_SCALE: return "sm_scale is not finite and > 0";
    case PW_PREFILL_ERR_BAD_WINDOW: return "window_left < -1";
    case PW_PREFILL_ERR_NEGATIVE_OFFSET: return "k_offset or v_offset < 0";
    case PW_PREFILL_ERR_SMEM_UNAVAILABLE: return "the device cannot provide the shared memory this tile needs";
    case PW_PREFILL_ERR_TOO_LARGE: return "num_kv_heads > 65535 or num_qo_heads * 256 past int32";
    case PW_PREFILL_ERR_NOT_SM90:
      return "the sm_90 prefill kernel needs a compute capability 9.0 device and a library built for sm_90a";
    default: return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown pagedwindow status";
  }
}
