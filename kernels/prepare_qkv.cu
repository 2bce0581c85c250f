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
// Work: a persistent grid (the SMs times the CTAs one SM holds) walks units of work, unit u = (token, block of up
// to kStageBytes of its head rows: q heads, then K heads, then V heads); CTA c takes units c, c + grid, ... up to
// the device-side total_tokens, so a captured graph stays valid after an in-place plan update. Each CTA keeps
// kStages - 1 units' rows in flight: cp.async copies them into shared-memory stages while it computes the unit
// before them, and computes the next unit's D/2 (cos, sin) pairs into the other half of a double-buffered table.
// One __syncthreads per unit hands a stage and a table from the copies to the compute and back. In the compute,
// a warp takes rows w, w + 8, ...; lane l holds elements [l*E, (l+1)*E) of a row, E = D/32, so lanes 0-15 hold the
// first half and lane l ^ 16 holds the rotation partner.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <atomic>

#include "ptx_common.cuh"

enum PwPrepareStatus {
  PW_PREPARE_OK = 0,
  PW_PREPARE_ERR_NULL_POINTER = -1,      // a required pointer is NULL
  PW_PREPARE_ERR_NONPOSITIVE_SIZE = -2,  // page_size, a head count or page_stride < 1, or a capacity < 0
  PW_PREPARE_ERR_HEAD_DIM = -3,          // head_dim not 64, 128, 256 or 512
  PW_PREPARE_ERR_NORM_STYLE = -4,        // norm_style not 0 (gemma4) or 1 (gemma3)
  PW_PREPARE_ERR_MISALIGNED = -5,        // an address, offset or stride not 16-byte aligned (weights: element)
  PW_PREPARE_ERR_BAD_SCALAR = -6,        // eps or an inverse frequency not finite and > 0
  PW_PREPARE_ERR_BAD_DTYPE = -8,         // dtype not 0 (bf16), 1 (fp16) or 2 (fp32)
  PW_PREPARE_ERR_NEGATIVE_OFFSET = -9,   // k_offset or v_offset < 0
  PW_PREPARE_ERR_TOO_LARGE = -11,        // a head count or an offset too large
};

namespace pw_prepare {

constexpr int kWarpSize = 32;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kCopyBytes = 16;       // one cp.async: a row is D * sizeof(T) >= 128 bytes, a whole number of them
constexpr int kStageBytes = 16384;   // one unit's head rows (a Gemma 4 local token's 32 rows at bf16, D 256)
constexpr int kStages = 4;           // units a CTA holds: kStages - 1 in flight while it computes one
constexpr int kMaxHalf = 256;        // inverse frequencies carried in the launch block: head_dim up to 512
constexpr int kPartnerLaneXor = 16;  // lane l holds the rotation partner of lane l ^ 16
constexpr unsigned kFullMask = 0xffffffffu;
constexpr double kInvPi = 0.318309886183790671537767526745;  // 1 / pi
constexpr int kMaxDevices = 64;

// Head rows in one unit: 8 (fp32, D 512) to 128 (bf16, D 64), always a multiple of kWarps.
template <typename T, int D>
__host__ __device__ constexpr int rows_per_unit() {
  return kStageBytes / (D * static_cast<int>(sizeof(T)));
}

// Dynamic shared memory: the stages, the double-buffered (cos, sin) table, then the q and k norms' factors.
template <int D>
__host__ __device__ constexpr int smem_bytes() {
  return kStages * kStageBytes + (2 * 2 * (D / 2) + 2 * D) * static_cast<int>(sizeof(float));
}

// CTAs an SM holds (the register cap; shared memory allows 3): 3 up to head_dim 256, 2 at 512.
template <int D>
__host__ __device__ constexpr int min_blocks_per_sm() {
  return D <= 256 ? 3 : 2;
}

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

// The norm's factor w (gemma4) or 1 + w (gemma3) in fp32, for all D elements, into shared memory.
template <typename T, int D>
__device__ __forceinline__ void fill_factor(const void* w, bool fp32, bool gemma4, float* out) {
  for (int i = threadIdx.x; i < D; i += kThreads) {
    const float x = fp32 ? static_cast<const float*>(w)[i] : Convert<T>::to_float(static_cast<const T*>(w)[i]);
    out[i] = gemma4 ? x : 1.0f + x;
  }
}

// The head rows of one token: q heads, then K heads, then V heads.
struct TokenRows {
  int hq, hkv;
  __device__ __forceinline__ int count() const { return hq + 2 * hkv; }
};

// Source of head row h of token t (elements).
template <typename T, int D>
__device__ __forceinline__ const T* source_row(const Params& p, TokenRows r, int t, int h) {
  if (h < r.hq) return static_cast<const T*>(p.q) + (static_cast<long long>(t) * r.hq + h) * D;
  if (h < r.hq + r.hkv) return static_cast<const T*>(p.k) + (static_cast<long long>(t) * r.hkv + h - r.hq) * D;
  return static_cast<const T*>(p.v) + (static_cast<long long>(t) * r.hkv + h - r.hq - r.hkv) * D;
}

// Unit u's token and first row (a unit is a token's rows [row0, row0 + kRowsPerUnit), clipped to its rows).
template <int kRowsPerUnit>
__device__ __forceinline__ void split_unit(long long u, int units_per_token, int* token, int* row0) {
  if (units_per_token == 1) {  // the common case: no 64-bit division
    *token = static_cast<int>(u);
    *row0 = 0;
    return;
  }
  *token = static_cast<int>(u / units_per_token);
  *row0 = static_cast<int>(u - static_cast<long long>(*token) * units_per_token) * kRowsPerUnit;
}

// Copy unit u's rows into a stage: chunk c of the unit lands at byte 16 c of the stage.
template <typename T, int D, int kRowsPerUnit>
__device__ __forceinline__ void copy_unit(const Params& p, TokenRows r, long long u, int units_per_token,
                                          uint32_t stage) {
  constexpr int kChunksPerRow = D * static_cast<int>(sizeof(T)) / kCopyBytes;
  int t, row0;
  split_unit<kRowsPerUnit>(u, units_per_token, &t, &row0);
  const int n = min(kRowsPerUnit, r.count() - row0);
  for (int c = threadIdx.x; c < n * kChunksPerRow; c += kThreads) {
    const int row = c / kChunksPerRow, col = c % kChunksPerRow;
    pw_ptx::cp_async_16(stage + c * kCopyBytes,
                        reinterpret_cast<const char*>(source_row<T, D>(p, r, t, row0 + row)) + col * kCopyBytes,
                        kCopyBytes);
  }
}

// Where one unit's rows go, from the plan (every thread of the CTA finds the same answer).
struct Unit {
  int token, row0;
  int pos;         // the token's KV position; -1 when the plan does not place it (then nothing is written)
  long long slot;  // element offset of its slot's [hkv, D] in the pool, before the layer's K or V offset
  __device__ __forceinline__ bool valid() const { return pos >= 0; }
};

template <int D, int kRowsPerUnit>
__device__ __forceinline__ Unit locate(const Params& p, TokenRows r, long long u, int units_per_token, int batch) {
  Unit a;
  split_unit<kRowsPerUnit>(u, units_per_token, &a.token, &a.row0);
  // Request of the token: the largest i in [0, batch) with qo_indptr[i] <= token (skips empty requests).
  int lo = 0, hi = batch;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (p.qo_indptr[mid] <= a.token) lo = mid;
    else hi = mid;
  }
  const int q_begin = p.qo_indptr[lo];
  const int q_end = p.qo_indptr[lo + 1];
  const int page_base = p.page_indptr[lo];
  const int kv_len = (p.page_indptr[lo + 1] - page_base - 1) * p.page_size + p.last_page_len[lo];
  a.pos = kv_len - (q_end - q_begin) + (a.token - q_begin);
  if (!(a.token >= q_begin && a.token < q_end && a.pos >= 0 && a.pos < kv_len)) a.pos = -1;
  a.slot = 0;
  if (a.valid()) {
    const int page_in_request = a.pos / p.page_size;
    const int slot = a.pos - page_in_request * p.page_size;
    a.slot = static_cast<long long>(p.page_indices[page_base + page_in_request]) * p.page_stride +
             static_cast<long long>(slot) * r.hkv * D;
  }
  return a;
}

// cos and sin of float(pos) * inv_freq[i] for i < D/2: the fp32 angle the math defines, its cos and sin in fp64
// through half-turns (the reduction mod 2 is exact, so no large-argument path and no stack frame at any position).
template <int D>
__device__ __forceinline__ void fill_table(const Params& p, int pos, float* cos_a, float* sin_a) {
  for (int i = threadIdx.x; i < D / 2; i += kThreads) {
    const float angle = static_cast<float>(pos) * p.inv_freq[i];
    const double half_turns = static_cast<double>(angle) * kInvPi;
    const double reduced = half_turns - 2.0 * rint(0.5 * half_turns);  // in [-1, 1]
    double s, c;
    sincospi(reduced, &s, &c);
    cos_a[i] = static_cast<float>(c);
    sin_a[i] = static_cast<float>(s);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, min_blocks_per_sm<D>()) pw_prepare_qkv_kernel(const Params p) {
  constexpr int E = D / kWarpSize;  // elements per lane
  constexpr int kHalf = D / 2;
  constexpr int kRowsPerUnit = rows_per_unit<T, D>();
  constexpr int kRowsPerWarp = kRowsPerUnit / kWarps;
  using Row = Chunk<T, E>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* const stages = reinterpret_cast<T*>(smem);                                 // [kStages][kRowsPerUnit][D]
  float* const table = reinterpret_cast<float*>(smem + kStages * kStageBytes);  // [2][cos, sin][kHalf]
  float* const factor_q = table + 2 * D;                                        // [D]
  float* const factor_k = factor_q + D;                                         // [D]

  const int total = min(p.plan_scalars[1], p.token_capacity);
  const int batch = min(p.plan_scalars[0], p.batch_capacity);
  if (total <= 0 || batch <= 0) return;
  const TokenRows r{p.num_qo_heads, p.num_kv_heads};
  const int units_per_token = (r.count() + kRowsPerUnit - 1) / kRowsPerUnit;
  const long long units = static_cast<long long>(total) * units_per_token;
  const long long grid = gridDim.x;
  long long u = blockIdx.x;
  if (u >= units) return;

  // Prologue: kStages - 1 units in flight before the first plan lookup and angle table.
  const uint32_t stage0 = pw_ptx::smem_addr(stages);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    const long long us = u + s * grid;
    if (us < units) copy_unit<T, D, kRowsPerUnit>(p, r, us, units_per_token, stage0 + s * kStageBytes);
    pw_ptx::cp_async_commit();
  }

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int c0 = lane * E;         // this lane's first element of a row
  const bool upper = c0 >= kHalf;  // second half of the row: x' = x cos + partner sin
  const int f0 = upper ? c0 - kHalf : c0;
  const bool gemma4 = p.norm_style == kGemma4;
  fill_factor<T, D>(p.q_weight, p.weight_fp32 != 0, gemma4, factor_q);  // published by the loop's first barrier
  fill_factor<T, D>(p.k_weight, p.weight_fp32 != 0, gemma4, factor_k);

  Unit cur = locate<D, kRowsPerUnit>(p, r, u, units_per_token, batch);
  if (cur.valid()) fill_table<D>(p, cur.pos, table, table + kHalf);

  for (int n = 0; u < units; ++n, u += grid) {
    pw_ptx::cp_async_wait<kStages - 2>();  // this thread's copies of unit n have landed
    __syncthreads();                       // everyone's have; the table of unit n is written; unit n - 1 is computed
    {
      const long long ua = u + (kStages - 1) * grid;  // into the stage unit n - 1 used
      if (ua < units)
        copy_unit<T, D, kRowsPerUnit>(p, r, ua, units_per_token, stage0 + ((n + kStages - 1) % kStages) * kStageBytes);
      pw_ptx::cp_async_commit();
    }

    // The next unit's plan lookups are issued before this unit's compute, so their latency overlaps it.
    Unit next;
    next.pos = -1;
    if (u + grid < units) next = locate<D, kRowsPerUnit>(p, r, u + grid, units_per_token, batch);

    if (cur.valid()) {
      const int rows = min(kRowsPerUnit, r.count() - cur.row0);
      const T* const stage = stages + (n % kStages) * (kStageBytes / sizeof(T));
      const float* const cos_a = table + (n & 1) * D;
      const float* const sin_a = cos_a + kHalf;
      // This warp's rows w, w + 8, ... in three passes over all of them (loads and squares, the butterfly sums,
      // then norm, RoPE and store), so the rows' shuffles and loads overlap.
      // (The rows stay in the stage between the passes: reading them twice costs less than holding them.)
      float sum_sq[kRowsPerWarp];
#pragma unroll
      for (int b = 0; b < kRowsPerWarp; ++b) {
        const int lr = warp + b * kWarps;  // warp-uniform
        sum_sq[b] = 0.0f;
        if (lr < rows) {
          const Row raw = *reinterpret_cast<const Row*>(stage + lr * D + c0);
#pragma unroll
          for (int j = 0; j < E; ++j) {
            const float x = Convert<T>::to_float(raw.v[j]);
            sum_sq[b] += x * x;
          }
        }
      }
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
#pragma unroll
        for (int b = 0; b < kRowsPerWarp; ++b) sum_sq[b] += __shfl_xor_sync(kFullMask, sum_sq[b], offset);
      }
      T* const q_out = static_cast<T*>(p.q_out) + static_cast<long long>(cur.token) * r.hq * D + c0;  // [hq, D]
      T* const k_slot = static_cast<T*>(p.pool) + cur.slot + p.k_offset + c0;                         // [hkv, D]
      T* const v_slot = static_cast<T*>(p.pool) + cur.slot + p.v_offset + c0;
#pragma unroll
      for (int b = 0; b < kRowsPerWarp; ++b) {
        const int lr = warp + b * kWarps;
        if (lr >= rows) break;
        const int h = cur.row0 + lr;
        const bool is_q = h < r.hq, is_v = h >= r.hq + r.hkv;
        Row* const dst = reinterpret_cast<Row*>(is_q   ? q_out + h * D
                                                : is_v ? v_slot + (h - r.hq - r.hkv) * D
                                                       : k_slot + (h - r.hq) * D);
        const Row raw = *reinterpret_cast<const Row*>(stage + lr * D + c0);
        if (is_v && !gemma4) {  // gemma3: V is written as given
          *dst = raw;
          continue;
        }
        const float inv_rms = 1.0f / sqrtf(sum_sq[b] / static_cast<float>(D) + p.eps);
        Row y;
        if (is_v) {
#pragma unroll
          for (int j = 0; j < E; ++j) y.v[j] = Convert<T>::from_float(Convert<T>::to_float(raw.v[j]) * inv_rms);
        } else {
          const float* const factor = (is_q ? factor_q : factor_k) + c0;
          float xn[E];
#pragma unroll
          for (int j = 0; j < E; ++j) xn[j] = Convert<T>::to_float(raw.v[j]) * inv_rms * factor[j];
#pragma unroll
          for (int j = 0; j < E; ++j) {
            const float partner = __shfl_xor_sync(kFullMask, xn[j], kPartnerLaneXor);
            const float sn = upper ? sin_a[f0 + j] : -sin_a[f0 + j];  // the sign of the partner's term
            y.v[j] = Convert<T>::from_float(xn[j] * cos_a[f0 + j] + partner * sn);
          }
        }
        *dst = y;
      }
    }

    // The next unit's angle table, into the half unit n - 1 read (published by the next iteration's barrier).
    if (next.valid()) fill_table<D>(p, next.pos, table + ((n + 1) & 1) * D, table + ((n + 1) & 1) * D + kHalf);
    cur = next;
  }
}

// Opt the kernel into its shared memory and find how many CTAs the device holds at once, once per device.
template <typename T, int D>
static int resident_ctas(int device, int* ctas) {
  static std::atomic<int> cache[kMaxDevices];
  if (device >= 0 && device < kMaxDevices) {
    const int c = cache[device].load(std::memory_order_acquire);
    if (c != 0) {
      *ctas = c;
      return 0;
    }
  }
  const auto kernel = pw_prepare_qkv_kernel<T, D>;
  constexpr int bytes = smem_bytes<D>();
  int sms = 0, per_sm = 0;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, bytes);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (per_sm < 1) return static_cast<int>(cudaErrorInvalidConfiguration);
  *ctas = sms * per_sm;
  if (device >= 0 && device < kMaxDevices) cache[device].store(*ctas, std::memory_order_release);
  return 0;
}

template <typename T, int D>
static int launch(const Params& p, cudaStream_t stream) {
  int device = 0, ctas = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return static_cast<int>(e);
  const int rc = resident_ctas<T, D>(device, &ctas);
  if (rc != 0) return rc;
  constexpr int kRowsPerUnit = rows_per_unit<T, D>();
  const long long units_per_token = (p.num_qo_heads + 2LL * p.num_kv_heads + kRowsPerUnit - 1) / kRowsPerUnit;
  const long long capacity_units = units_per_token * p.token_capacity;
  const unsigned grid = static_cast<unsigned>(capacity_units < ctas ? capacity_units : ctas);
  pw_prepare_qkv_kernel<T, D><<<grid, kThreads, smem_bytes<D>(), stream>>>(p);
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

  // The copies move 16 bytes (cp.async) and a lane stores head_dim / 32 elements: every address, offset and
  // stride of the tensors and the pool must be a multiple of 16 bytes.
  const int elem_bytes = a->dtype == 2 ? 4 : 2;
  const unsigned long long align = kCopyBytes;
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
    case PW_PREPARE_ERR_MISALIGNED:
      return "an address, offset or stride is not a multiple of 16 bytes (weights: of their element)";
    case PW_PREPARE_ERR_BAD_SCALAR: return "eps or an inverse frequency is not finite and > 0";
    case PW_PREPARE_ERR_BAD_DTYPE: return "dtype is not 0 (bf16), 1 (fp16) or 2 (fp32)";
    case PW_PREPARE_ERR_NEGATIVE_OFFSET: return "k_offset or v_offset < 0";
    case PW_PREPARE_ERR_TOO_LARGE: return "a head count or an offset is too large";
    default: return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown pagedwindow status";
  }
}
