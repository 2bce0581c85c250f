// pagedwindow: pool write ("append"): scatter each request's new K and V rows into their page slots.
//
// Pool layout (one contiguous tensor): [num_pages, num_layers, 2 (K, V), page_size, num_kv_heads, head_dim].
// New row t (0 <= t < total_tokens, global over the batch) belongs to request r with
// qo_indptr[r] <= t < qo_indptr[r+1]; its KV position is pos = kv_len_r - seq_r + (t - qo_indptr[r]) with
// kv_len_r = (page_indptr[r+1] - page_indptr[r] - 1) * page_size + last_page_len[r]; it lands in page
// page_indices[page_indptr[r] + pos / page_size], slot pos % page_size. Within a slot the heads are contiguous
// ([num_kv_heads, head_dim]), exactly like one row of k / v, so one token is one contiguous copy of
// num_kv_heads * head_dim elements for K and one for V. A plain bit-exact copy, vectorised to 16 bytes when
// every address and stride allows it (else 8, 4 or 2 bytes).
//
// One CTA per token of the capacity; batch_size and total_tokens are read on the device from plan_scalars
// (so a captured CUDA graph stays valid after the plan is updated in place); CTAs past total_tokens return.

#include <cuda_runtime.h>
#include <stdint.h>

#include "launch_blocks.cuh"  // PwAppendLaunch, the launch block (also read by launch_gate.cpp)

enum PwAppendStatus {
  PW_APPEND_OK = 0,
  PW_APPEND_ERR_NULL_POINTER = -1,      // a required pointer is NULL
  PW_APPEND_ERR_NONPOSITIVE_SIZE = -2,  // page_size, num_kv_heads, head_dim, page_stride < 1, or a capacity < 0
  PW_APPEND_ERR_MISALIGNED = -5,        // an address or offset is not a multiple of elem_bytes
  PW_APPEND_ERR_BAD_ELEM_BYTES = -8,    // elem_bytes not 2 or 4
  PW_APPEND_ERR_NEGATIVE_OFFSET = -9,   // k_offset or v_offset < 0
  PW_APPEND_ERR_TOO_LARGE = -11,        // num_kv_heads * head_dim * elem_bytes past int32
};

namespace pw_append {

constexpr int kThreads = 128;

struct Params {
  const unsigned char* k;
  const unsigned char* v;
  unsigned char* pool;
  long long k_offset_bytes;
  long long v_offset_bytes;
  long long page_stride_bytes;
  long long row_bytes;  // num_kv_heads * head_dim * elem_bytes: one token of k (and one slot of the pool)
  const int* page_indices;
  const int* page_indptr;
  const int* last_page_len;
  const int* qo_indptr;
  const int* plan_scalars;
  int page_size;
  int batch_capacity;
  int token_capacity;
};

template <typename Vec>
__global__ void __launch_bounds__(kThreads) pw_append_paged_kv_kernel(const Params p) {
  const int t = blockIdx.x;
  const int total = min(p.plan_scalars[1], p.token_capacity);
  if (t >= total) return;
  const int batch = min(p.plan_scalars[0], p.batch_capacity);
  if (batch <= 0) return;

  // Request of token t: the largest r in [0, batch) with qo_indptr[r] <= t (skips empty requests).
  int lo = 0, hi = batch;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (p.qo_indptr[mid] <= t) lo = mid;
    else hi = mid;
  }
  const int r = lo;
  const int q_begin = p.qo_indptr[r];
  const int q_end = p.qo_indptr[r + 1];
  if (t < q_begin || t >= q_end) return;  // inconsistent plan: write nothing
  const int page_base = p.page_indptr[r];
  const int num_pages = p.page_indptr[r + 1] - page_base;
  const int kv_len = (num_pages - 1) * p.page_size + p.last_page_len[r];
  const int pos = kv_len - (q_end - q_begin) + (t - q_begin);
  if (pos < 0 || pos >= kv_len) return;  // inconsistent plan: write nothing
  const int pi = pos / p.page_size;
  const int slot = pos - pi * p.page_size;
  const long long page = p.page_indices[page_base + pi];

  unsigned char* slot_base = p.pool + page * p.page_stride_bytes + static_cast<long long>(slot) * p.row_bytes;
  const Vec* __restrict__ ks = reinterpret_cast<const Vec*>(p.k + static_cast<long long>(t) * p.row_bytes);
  const Vec* __restrict__ vs = reinterpret_cast<const Vec*>(p.v + static_cast<long long>(t) * p.row_bytes);
  Vec* __restrict__ kd = reinterpret_cast<Vec*>(slot_base + p.k_offset_bytes);
  Vec* __restrict__ vd = reinterpret_cast<Vec*>(slot_base + p.v_offset_bytes);
  const int n = static_cast<int>(p.row_bytes / static_cast<long long>(sizeof(Vec)));
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const Vec a = ks[i];
    const Vec b = vs[i];
    kd[i] = a;
    vd[i] = b;
  }
}

template <typename Vec>
static int launch(const Params& p, cudaStream_t stream) {
  pw_append_paged_kv_kernel<Vec><<<static_cast<unsigned>(p.token_capacity), kThreads, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace pw_append


// Validate `a`, then launch on `stream`. Returns 0, a negative status (nothing launched) or a cudaError_t.
extern "C" int pw_append_paged_kv(const PwAppendLaunch* a, void* stream) {
  using namespace pw_append;
  if (a == nullptr) return PW_APPEND_ERR_NULL_POINTER;
  const void* const k = a->k;
  const void* const v = a->v;
  void* const pool = a->pool;
  const long long k_offset = a->k_offset, v_offset = a->v_offset, page_stride = a->page_stride;
  const int page_size = a->page_size, num_kv_heads = a->num_kv_heads, head_dim = a->head_dim;
  const int elem_bytes = a->elem_bytes, batch_capacity = a->batch_capacity, token_capacity = a->token_capacity;
  const int *page_indices = a->page_indices, *page_indptr = a->page_indptr, *last_page_len = a->last_page_len;
  const int *qo_indptr = a->qo_indptr, *plan_scalars = a->plan_scalars;
  if (k == nullptr || v == nullptr || pool == nullptr || page_indices == nullptr || page_indptr == nullptr ||
      last_page_len == nullptr || qo_indptr == nullptr || plan_scalars == nullptr)
    return PW_APPEND_ERR_NULL_POINTER;
  if (elem_bytes != 2 && elem_bytes != 4) return PW_APPEND_ERR_BAD_ELEM_BYTES;
  if (page_size < 1 || num_kv_heads < 1 || head_dim < 1 || page_stride < 1 || batch_capacity < 0 || token_capacity < 0)
    return PW_APPEND_ERR_NONPOSITIVE_SIZE;
  if (k_offset < 0 || v_offset < 0) return PW_APPEND_ERR_NEGATIVE_OFFSET;
  const long long row_bytes = static_cast<long long>(num_kv_heads) * head_dim * elem_bytes;
  if (row_bytes > 0x7fffffffLL || k_offset > (0x7fffffffffffffffLL / 4) || v_offset > (0x7fffffffffffffffLL / 4) ||
      page_stride > (0x7fffffffffffffffLL / 4))
    return PW_APPEND_ERR_TOO_LARGE;
  if (token_capacity == 0 || batch_capacity == 0) return PW_APPEND_OK;  // nothing can be written

  Params p;
  p.k = static_cast<const unsigned char*>(k);
  p.v = static_cast<const unsigned char*>(v);
  p.pool = static_cast<unsigned char*>(pool);
  p.k_offset_bytes = k_offset * elem_bytes;
  p.v_offset_bytes = v_offset * elem_bytes;
  p.page_stride_bytes = page_stride * elem_bytes;
  p.row_bytes = row_bytes;
  p.page_indices = page_indices;
  p.page_indptr = page_indptr;
  p.last_page_len = last_page_len;
  p.qo_indptr = qo_indptr;
  p.plan_scalars = plan_scalars;
  p.page_size = page_size;
  p.batch_capacity = batch_capacity;
  p.token_capacity = token_capacity;

  // Widest vector that divides every address, offset and stride the copy touches.
  const unsigned long long bits =
      reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v) | reinterpret_cast<uintptr_t>(pool) |
      static_cast<unsigned long long>(p.k_offset_bytes) | static_cast<unsigned long long>(p.v_offset_bytes) |
      static_cast<unsigned long long>(p.page_stride_bytes) | static_cast<unsigned long long>(row_bytes);
  if ((bits & static_cast<unsigned long long>(elem_bytes - 1)) != 0) return PW_APPEND_ERR_MISALIGNED;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if ((bits & 15u) == 0) return launch<uint4>(p, s);
  if ((bits & 7u) == 0) return launch<uint2>(p, s);
  if ((bits & 3u) == 0) return launch<unsigned int>(p, s);
  return launch<unsigned short>(p, s);  // elem_bytes == 2 and only 2-byte alignment
}

// sizeof(PwAppendLaunch), for the host's check of its mirror of the struct.
extern "C" int pw_append_launch_size(void) { return static_cast<int>(sizeof(PwAppendLaunch)); }

extern "C" const char* pw_append_paged_kv_error_string(int code) {
  switch (code) {
    case PW_APPEND_OK: return "ok";
    case PW_APPEND_ERR_NULL_POINTER: return "a required pointer is NULL";
    case PW_APPEND_ERR_NONPOSITIVE_SIZE:
      return "page_size, num_kv_heads, head_dim or page_stride < 1, or a capacity < 0";
    case PW_APPEND_ERR_MISALIGNED: return "an address or offset is not a multiple of elem_bytes";
    case PW_APPEND_ERR_BAD_ELEM_BYTES: return "elem_bytes is not 2 or 4";
    case PW_APPEND_ERR_NEGATIVE_OFFSET: return "k_offset or v_offset < 0";
    case PW_APPEND_ERR_TOO_LARGE: return "num_kv_heads * head_dim * elem_bytes past int32, or an offset too large";
    default: return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown pagedwindow status";
  }
}
