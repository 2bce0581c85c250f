// pagedwindow: Gemma's prep before attention, fused into one launch: the q/k/v RMSNorms, rotate-half RoPE on q
// and k, the normed q written to q_out and the normed, rotated K and the normed V scattered into their page slots.
//
// Math (src/pagedwindow/gemma_prep.py states it): x̂ = x / sqrt(mean(x^2) + eps) over the head, fp32;
// norm_style 0 ("gemma4"): q, k times w, v unweighted; 1 ("gemma3"): q, k times (1 + w), v copied as given.
// RoPE: angle a_i = float(pos) * inv_freq[i] in fp32 (i < D/2); x'[i] = x[i] cos a_i - x[i + D/2] sin a_i,
// x'[i + D/2] = x[i + D/2] cos a_i + x[i] sin a_i. One rounding to the output dtype.
//
// Geometry: exactly the pool write's (append_paged_kv.cu): new row t of request r sits at KV position
// pos = kv_len_r - seq_r + (t - qo_indptr[r]), page page_indices[page_indptr[r] + pos / page_size], slot
// pos % page_size; pool layout [num_pages, num_layers, 2 (K, V), page_size, num_kv_heads, head_dim].
//
// Work: one CTA per token of the capacity (CTAs past the device-side total_tokens return, so a captured graph
// stays valid after an in-place plan update). The CTA issues its first head rows' loads, then computes the token's D/2
// (cos, sin) pairs into shared memory, then each warp takes head rows (q heads, then K heads, then V heads)
// kRowsPerPass at a time: it loads all of them before it computes (bytes in flight), and lane l holds elements [l*E,
// (l+1)*E) of a row, E = D/32, so lanes 0-15 hold the first half and lane l ^ 16 holds the rotation partner.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

enum PwPrepareStatus {
  PW_PREPARE_OK = 0,
  PW_PREPARE_ERR_NULL_POINTER = -1,      // a required pointer is NULL
  PW_PREPARE_ERR_NONPOSITIVE_SIZE = -2,  // page_size, a head count or page_stride < 1, or a capacity < 0
  PW_PREPARE_ERR_HEAD_DIM = -3,          // head_dim not 64, 128, 256 or 512
  PW_PREPARE_ERR_NORM_STYLE = -4,        // norm_style not 0 (gemma4) or 1 (gemma3)
  PW_PREPARE_ERR_MISALIGNED = -5,        // an address, offset or stride not a multiple of a lane's chunk
  PW_PREPARE_ERR_BAD_SCALAR = -6,        // eps or an inverse frequency not finite and > 0
  PW_PREPARE_ERR_BAD_DTYPE = -8,         // dtype not 0 (bf16), 1 (fp16) or 2 (fp32)
  PW_PREPARE_ERR_NEGATIVE_OFFSET = -9,   // k_offset or v_offset < 0
  PW_PREPARE_ERR_TOO_LARGE = -11,        // a head count or an offset too large
};

namespace pw_prepare {

constexpr int kWarpSize = 32;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
// Head rows a warp loads before it computes any of them: 64 bytes in flight per lane, at most 4 rows.
template <typename T, int D>
__host__ __device__ constexpr int rows_per_pass() {
  return (D / 32) * sizeof(T) >= 64 ? 1 : (D / 32) * sizeof(T) >= 32 ? 2 : 4;
}

// CTAs an SM holds (the register cap): 32 warps at head_dim 128 and below, 24 at 256, 16 at 512.
template <int D>
__host__ __device__ constexpr int min_blocks_per_sm() {
  return D <= 128 ? 4 : D <= 256 ? 3 : 2;
}
constexpr int kMaxHalf = 256;        // inverse frequencies carried in the launch block: head_dim up to 512
constexpr int kPartnerLaneXor = 16;  // lane l holds the rotation partner of lane l ^ 16
constexpr unsigned kFullMask = 0xffffffffu;
constexpr double kInvPi = 0.318309886183790671537767526745;  // 1 / pi

enum NormStyle { kGemma4 = 0, kGemma3 = 1 };

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* q_out;
  void* pool;
  const void* q_weight;
  const void* k_weight;
  long long k_offset;  // elements
  long long v_offset;
  long long page_stride;
  const int* page_indices;
  const int* page_indptr;
  const int* last_page_len;
  const int* qo_indptr;
  const int* plan_scalars;
  int page_size;
  int num_qo_heads;
  int num_kv_heads;
  int batch_capacity;
  int token_capacity;
  int weight_fp32;  // the norm weights are fp32 (else the tensors' dtype)
  int norm_style;
  float eps;
  float inv_freq[kMaxHalf];
};

template <typename T>
struct Convert;
template <>
struct Convert<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Convert<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};
template <>
struct Convert<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

// One lane's E contiguous elements of a head row, aligned so the compiler moves it in the widest vectors.
template <typename T, int E>
struct alignas(E * sizeof(T) < 16 ? E * sizeof(T) : 16) Chunk {
  T v[E];
};

template <typename T, int E>
__device__ __forceinline__ void load_weight(const void* w, bool fp32, int c0, float (&out)[E]) {
#pragma unroll
  for (int j = 0; j < E; ++j)
    out[j] = fp32 ? static_cast<const float*>(w)[c0 + j] : Convert<T>::to_float(static_cast<const T*>(w)[c0 + j]);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, min_blocks_per_sm<D>()) pw_prepare_qkv_kernel(const Params p) {
  constexpr int E = D / kWarpSize;  // elements per lane
  constexpr int kHalf = D / 2;
  constexpr int kRowsPerPass = rows_per_pass<T, D>();
  using Row = Chunk<T, E>;
  __shared__ float cos_a[kHalf];
  __shared__ float sin_a[kHalf];

  const int t = blockIdx.x;
  const int total = min(p.plan_scalars[1], p.token_capacity);
  if (t >= total) return;
  const int batch = min(p.plan_scalars[0], p.batch_capacity);
  if (batch <= 0) return;

  const int hq = p.num_qo_heads, hkv = p.num_kv_heads;
  const int rows = hq + 2 * hkv;  // head rows of this token: q heads, then K heads, then V heads
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int c0 = lane * E;         // this lane's first element of a row
  const bool upper = c0 >= kHalf;  // second half of the row: x' = x cos + partner sin
  const int f0 = upper ? c0 - kHalf : c0;

  const T* const q = static_cast<const T*>(p.q) + static_cast<long long>(t) * hq * D + c0;   // [hq, D] of t
  const T* const k = static_cast<const T*>(p.k) + static_cast<long long>(t) * hkv * D + c0;  // [hkv, D]
  const T* const v = static_cast<const T*>(p.v) + static_cast<long long>(t) * hkv * D + c0;  // [hkv, D]
  auto source = [&](int h) -> const Row* {
    return reinterpret_cast<const Row*>(h < hq ? q + h * D : h < hq + hkv ? k + (h - hq) * D : v + (h - hq - hkv) * D);
  };
  // The first pass's loads depend on nothing but t: issue them before the plan lookups and the angle table,
  // so their latency overlaps both.
  Row raw[kRowsPerPass];
#pragma unroll
  for (int b = 0; b < kRowsPerPass; ++b)
    if (warp + b * kWarps < rows) raw[b] = *source(warp + b * kWarps);

  // Request of token t: the largest r in [0, batch) with qo_indptr[r] <= t (skips empty requests).
  int lo = 0, hi = batch;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (p.qo_indptr[mid] <= t) lo = mid;
    else hi = mid;
  }
  const int q_begin = p.qo_indptr[lo];
  const int q_end = p.qo_indptr[lo + 1];
  if (t < q_begin || t >= q_end) return;  // inconsistent plan: write nothing
  const int page_base = p.page_indptr[lo];
  const int kv_len = (p.page_indptr[lo + 1] - page_base - 1) * p.page_size + p.last_page_len[lo];
  const int pos = kv_len - (q_end - q_begin) + (t - q_begin);
  if (pos < 0 || pos >= kv_len) return;  // inconsistent plan: write nothing (uniform over the CTA)
  const int page_in_request = pos / p.page_size;
  const int slot = pos - page_in_request * p.page_size;
  const long long page = p.page_indices[page_base + page_in_request];

  T* const q_out = static_cast<T*>(p.q_out) + static_cast<long long>(t) * hq * D + c0;
  T* const slot_base = static_cast<T*>(p.pool) + page * p.page_stride + static_cast<long long>(slot) * hkv * D + c0;
  T* const k_slot = slot_base + p.k_offset;  // [hkv, D] of this slot
  T* const v_slot = slot_base + p.v_offset;

  auto destination = [&](int h) -> Row* {
    return reinterpret_cast<Row*>(h < hq         ? q_out + h * D
                                  : h < hq + hkv ? k_slot + (h - hq) * D
                                                 : v_slot + (h - hq - hkv) * D);
  };

  for (int i = threadIdx.x; i < kHalf; i += kThreads) {
    const float angle = static_cast<float>(pos) * p.inv_freq[i];  // fp32, as the math defines it
    // cos and sin of that fp32 value, in fp64 through half-turns: the reduction mod 2 is exact, so no
    // large-argument path (and no stack frame) is needed at any position.
    const double half_turns = static_cast<double>(angle) * kInvPi;
    const double reduced = half_turns - 2.0 * rint(0.5 * half_turns);  // in [-1, 1]
    double s, c;
    sincospi(reduced, &s, &c);
    cos_a[i] = static_cast<float>(c);
    sin_a[i] = static_cast<float>(s);
  }
  __syncthreads();
  const bool gemma4 = p.norm_style == kGemma4;
  const bool weight_fp32 = p.weight_fp32 != 0;

  for (int h0 = warp; h0 < rows; h0 += kWarps * kRowsPerPass) {
    if (h0 != warp) {
#pragma unroll
      for (int b = 0; b < kRowsPerPass; ++b)
        if (h0 + b * kWarps < rows) raw[b] = *source(h0 + b * kWarps);
    }
#pragma unroll
    for (int b = 0; b < kRowsPerPass; ++b) {
      const int h = h0 + b * kWarps;  // warp-uniform
      if (h >= rows) break;
      const bool is_v = h >= hq + hkv;
      if (is_v && !gemma4) {  // gemma3: V is written as given
        *destination(h) = raw[b];
        continue;
      }
      float x[E];
      float sum_sq = 0.0f;
#pragma unroll
      for (int j = 0; j < E; ++j) {
        x[j] = Convert<T>::to_float(raw[b].v[j]);
        sum_sq += x[j] * x[j];
      }
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) sum_sq += __shfl_xor_sync(kFullMask, sum_sq, offset);
      const float inv_rms = 1.0f / sqrtf(sum_sq / static_cast<float>(D) + p.eps);
      Row y;
      if (is_v) {
#pragma unroll
        for (int j = 0; j < E; ++j) y.v[j] = Convert<T>::from_float(x[j] * inv_rms);
      } else {
        float w[E];  // the norm's factor: w (gemma4) or 1 + w (gemma3)
        load_weight<T, E>(h < hq ? p.q_weight : p.k_weight, weight_fp32, c0, w);
#pragma unroll
        for (int j = 0; j < E; ++j) x[j] = x[j] * inv_rms * (gemma4 ? w[j] : 1.0f + w[j]);
#pragma unroll
        for (int j = 0; j < E; ++j) {
          const float partner = __shfl_xor_sync(kFullMask, x[j], kPartnerLaneXor);
          const float s = upper ? sin_a[f0 + j] : -sin_a[f0 + j];  // the sign of the partner's term
          y.v[j] = Convert<T>::from_float(x[j] * cos_a[f0 + j] + partner * s);
        }
      }
      *destination(h) = y;
    }
  }
}

template <typename T, int D>
static int launch(const Params& p, cudaStream_t stream) {
  pw_prepare_qkv_kernel<T, D><<<static_cast<unsigned>(p.token_capacity), kThreads, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
static int launch_for_head_dim(const Params& p, int head_dim, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch<T, 64>(p, stream);
    case 128: return launch<T, 128>(p, stream);
    case 256: return launch<T, 256>(p, stream);
    default: return launch<T, 512>(p, stream);
  }
}

}  // namespace pw_prepare

// The launch parameter block (mirrored by a ctypes.Structure in src/pagedwindow/cuda/ops.py; the host checks
// sizeof against pw_prepare_launch_size()). Pointers are device addresses; offsets and strides in elements.
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

// Validate `a`, then launch on `stream`. Returns 0, a negative status (nothing launched) or a cudaError_t.
extern "C" int pw_prepare_qkv(const PwPrepareLaunch* a, void* stream) {
  using namespace pw_prepare;
  if (a == nullptr) return PW_PREPARE_ERR_NULL_POINTER;
  if (a->q == nullptr || a->k == nullptr || a->v == nullptr || a->q_out == nullptr || a->pool == nullptr ||
      a->q_weight == nullptr || a->k_weight == nullptr || a->page_indices == nullptr || a->page_indptr == nullptr ||
      a->last_page_len == nullptr || a->qo_indptr == nullptr || a->plan_scalars == nullptr)
    return PW_PREPARE_ERR_NULL_POINTER;
  if (a->dtype < 0 || a->dtype > 2) return PW_PREPARE_ERR_BAD_DTYPE;
  const int head_dim = a->head_dim;
  if (head_dim != 64 && head_dim != 128 && head_dim != 256 && head_dim != 512) return PW_PREPARE_ERR_HEAD_DIM;
  if (a->norm_style != kGemma4 && a->norm_style != kGemma3) return PW_PREPARE_ERR_NORM_STYLE;
  if (a->page_size < 1 || a->num_qo_heads < 1 || a->num_kv_heads < 1 || a->page_stride < 1 || a->batch_capacity < 0 ||
      a->token_capacity < 0)
    return PW_PREPARE_ERR_NONPOSITIVE_SIZE;
  if (a->k_offset < 0 || a->v_offset < 0) return PW_PREPARE_ERR_NEGATIVE_OFFSET;
  if (static_cast<long long>(a->num_qo_heads) + 2LL * a->num_kv_heads > 0x7fffffffLL ||
      a->k_offset > (0x7fffffffffffffffLL / 8) || a->v_offset > (0x7fffffffffffffffLL / 8) ||
      a->page_stride > (0x7fffffffffffffffLL / 8))
    return PW_PREPARE_ERR_TOO_LARGE;
  if (!(a->eps > 0.0f) || !isfinite(a->eps)) return PW_PREPARE_ERR_BAD_SCALAR;
  for (int i = 0; i < head_dim / 2; ++i)
    if (!(a->inv_freq[i] > 0.0f) || !isfinite(a->inv_freq[i])) return PW_PREPARE_ERR_BAD_SCALAR;

  // A lane moves head_dim / 32 elements: every address, offset and stride must be a multiple of that chunk
  // (16 bytes at most, the widest vector).
  const int elem_bytes = a->dtype == 2 ? 4 : 2;
  const long long chunk = static_cast<long long>(head_dim / kWarpSize) * elem_bytes;
  const unsigned long long align = static_cast<unsigned long long>(chunk < 16 ? chunk : 16);
  const unsigned long long bits = reinterpret_cast<uintptr_t>(a->q) | reinterpret_cast<uintptr_t>(a->k) |
                                  reinterpret_cast<uintptr_t>(a->v) | reinterpret_cast<uintptr_t>(a->q_out) |
                                  reinterpret_cast<uintptr_t>(a->pool) |
                                  static_cast<unsigned long long>(a->k_offset * elem_bytes) |
                                  static_cast<unsigned long long>(a->v_offset * elem_bytes) |
                                  static_cast<unsigned long long>(a->page_stride * elem_bytes);
  const int weight_bytes = a->weight_fp32 ? 4 : elem_bytes;
  const unsigned long long weight_bits =
      reinterpret_cast<uintptr_t>(a->q_weight) | reinterpret_cast<uintptr_t>(a->k_weight);
  if ((bits & (align - 1)) != 0 || (weight_bits & static_cast<unsigned long long>(weight_bytes - 1)) != 0)
    return PW_PREPARE_ERR_MISALIGNED;
  if (a->token_capacity == 0 || a->batch_capacity == 0) return PW_PREPARE_OK;  // nothing can be written

  Params p;
  p.q = a->q;
  p.k = a->k;
  p.v = a->v;
  p.q_out = a->q_out;
  p.pool = a->pool;
  p.q_weight = a->q_weight;
  p.k_weight = a->k_weight;
  p.k_offset = a->k_offset;
  p.v_offset = a->v_offset;
  p.page_stride = a->page_stride;
  p.page_indices = a->page_indices;
  p.page_indptr = a->page_indptr;
  p.last_page_len = a->last_page_len;
  p.qo_indptr = a->qo_indptr;
  p.plan_scalars = a->plan_scalars;
  p.page_size = a->page_size;
  p.num_qo_heads = a->num_qo_heads;
  p.num_kv_heads = a->num_kv_heads;
  p.batch_capacity = a->batch_capacity;
  p.token_capacity = a->token_capacity;
  p.weight_fp32 = a->weight_fp32 ? 1 : 0;
  p.norm_style = a->norm_style;
  p.eps = a->eps;
  for (int i = 0; i < kMaxHalf; ++i) p.inv_freq[i] = i < head_dim / 2 ? a->inv_freq[i] : 0.0f;

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a->dtype) {
    case 0: return launch_for_head_dim<__nv_bfloat16>(p, head_dim, s);
    case 1: return launch_for_head_dim<__half>(p, head_dim, s);
    default: return launch_for_head_dim<float>(p, head_dim, s);
  }
}

// sizeof(PwPrepareLaunch), for the host's check of its mirror of the struct.
extern "C" int pw_prepare_launch_size(void) { return static_cast<int>(sizeof(PwPrepareLaunch)); }

extern "C" const char* pw_prepare_qkv_error_string(int code) {
  switch (code) {
    case PW_PREPARE_OK: return "ok";
    case PW_PREPARE_ERR_NULL_POINTER: return "a required pointer is NULL";
    case PW_PREPARE_ERR_NONPOSITIVE_SIZE: return "page_size, a head count or page_stride < 1, or a capacity < 0";
    case PW_PREPARE_ERR_HEAD_DIM: return "head_dim is not 64, 128, 256 or 512";
    case PW_PREPARE_ERR_NORM_STYLE: return "norm_style is not 0 (gemma4) or 1 (gemma3)";
    case PW_PREPARE_ERR_MISALIGNED: return "an address, offset or stride is not a multiple of a lane's chunk";
    case PW_PREPARE_ERR_BAD_SCALAR: return "eps or an inverse frequency is not finite and > 0";
    case PW_PREPARE_ERR_BAD_DTYPE: return "dtype is not 0 (bf16), 1 (fp16) or 2 (fp32)";
    case PW_PREPARE_ERR_NEGATIVE_OFFSET: return "k_offset or v_offset < 0";
    case PW_PREPARE_ERR_TOO_LARGE: return "a head count or an offset is too large";
    default: return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown pagedwindow status";
  }
}
