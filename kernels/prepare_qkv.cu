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
// the device-side total_tokens, so a captured graph stays valid after an in-place plan update. A CTA is one
// producer warp and kConsumerWarps consumer warps around a ring of kStages stages, each stage a unit's rows, its
// rotation table and its location, handed over by two mbarriers (full: rows landed, table and location written;
// empty: every consumer thread is done with it). The producer loads a unit's rows (bulk copies on sm_90, cp.async
// elsewhere), then looks the unit up in the plan and computes its rotation table while the copies fly, up to
// kStages units ahead of the consumers. In the compute, consumer warp w takes rows w, w + 8, ...; lane l holds
// elements [l*E, (l+1)*E) of a row, E = D/32, so lanes 0-15 hold the first half and lane l ^ 16 holds the
// rotation partner.
//
// The rotation table folds the norm's factor f (w or 1 + w) into the angles, per unit and per tensor (q, k):
// A[i] = f[i] cos a, B[i] = -f[i + D/2] sin a, A[i + D/2] = f[i + D/2] cos a, B[i + D/2] = f[i] sin a (a = a_i),
// so that a row's element is y[i] = r (x[i] A[i] + x[partner(i)] B[i]) with r = rsqrt(mean(x^2) + eps): the
// math above, its products taken in another order (fp32 throughout, one rounding to the output dtype).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>

#include "launch_blocks.cuh"  // PwPrepareLaunch, the launch block (also read by launch_gate.cpp)
#include "ptx_common.cuh"     // cp.async, the mbarrier operations sm_80 has
#include "sm90_ptx.cuh"       // PW_SM90_DEVICE_CODE: bulk copies, transaction counts, the watchdog wait

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
constexpr int kConsumerWarps = 8;  // warps 0-7 normalise and rotate; warp 8 loads
constexpr int kProducerWarp = kConsumerWarps;
constexpr int kThreads = (kConsumerWarps + 1) * kWarpSize;
constexpr int kCopyBytes = 16;      // one cp.async: a row is D * sizeof(T) >= 128 bytes, a whole number of them
constexpr int kStageBytes = 16384;  // one unit's head rows (a Gemma 4 local token's 32 rows at bf16, D 256)
#ifndef PW_PREPARE_STAGES
#define PW_PREPARE_STAGES 3
#endif
constexpr int kStages = PW_PREPARE_STAGES;  // units a CTA holds: the one computed and up to kStages - 1 landing
constexpr int kPartnerLaneXor = 16;         // lane l holds the rotation partner of lane l ^ 16
constexpr unsigned kFullMask = 0xffffffffu;
constexpr double kInvPi = 0.318309886183790671537767526745;  // 1 / pi
constexpr int kMaxDevices = 64;

// How the producer loads a unit's rows: bulk copies on sm_90, cp.async elsewhere (and on sm_90 too when built
// with -DPW_PREPARE_CP_ASYNC_LOADS, so that a Hopper GPU can test that path).
#if defined(PW_SM90_DEVICE_CODE) && !defined(PW_PREPARE_CP_ASYNC_LOADS)
#define PW_PREPARE_BULK_LOADS 1
#else
#define PW_PREPARE_BULK_LOADS 0
#endif

// Arrivals that complete a stage's full barrier: each producer lane once its table entries are written, and the
// rows' landing — one arrive that sets the bulk copies' transaction count, or each lane's cp.async arrive. The
// empty barrier completes when every consumer thread has arrived.
#if PW_PREPARE_BULK_LOADS
constexpr int kFullArrivals = kWarpSize + 1;
#else
constexpr int kFullArrivals = 2 * kWarpSize;
#endif
// Every consumer thread arrives on `empty` itself, releasing its own reads of the stage: compute-sanitizer's
// racecheck does not carry a warp's reads through __syncwarp into one lane's arrive (it reports the stage's reuse
// as a race; benchmarks/racecheck_control.cu shows both), and the per-thread arrive costs no time (runs 77, 80).
constexpr int kEmptyArrivals = kConsumerWarps * kWarpSize;

// Head rows in one unit: 8 (fp32, D 512) to 128 (bf16, D 64), always a multiple of kConsumerWarps.
template <typename T, int D>
__host__ __device__ constexpr int rows_per_unit() {
  return kStageBytes / (D * static_cast<int>(sizeof(T)));
}

// Floats of one unit's rotation table: [q, k][A, B][D].
template <int D>
__host__ __device__ constexpr int table_floats() {
  return 2 * 2 * D;
}

constexpr int kUnitSlotBytes = 32;  // one Unit (sizeof(Unit) <= 32, checked in the kernel)

// Dynamic shared memory, per stage: the rows [kStages][kStageBytes], the rotation tables [kStages][table], the
// units' locations [kStages][32 B], then the full and the empty mbarriers [kStages] each.
template <int D>
struct SmemMap {
  static constexpr int kTableBytes = table_floats<D>() * static_cast<int>(sizeof(float));
  static constexpr int kTables = kStages * kStageBytes;
  static constexpr int kUnits = kTables + kStages * kTableBytes;
  static constexpr int kFull = kUnits + kStages * kUnitSlotBytes;
  static constexpr int kEmpty = kFull + kStages * 8;
  static constexpr int kBytes = kEmpty + kStages * 8;
};

// CTAs an SM should hold, which caps the registers: 3 up to head_dim 256, 2 at 512 (Hopper's shared memory holds 3
// at three stages; smaller parts hold fewer, and the launcher's occupancy query sizes the grid by what fits).
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
};

// RoPE's inverse frequencies, a kernel parameter of their own sized by the head dim, so that the launch carries
// D / 2 floats rather than the launch block's kMaxHalf.
template <int D>
struct RopeFreqs {
  float inv_freq[D / 2];
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

// The partner lane's (l ^ 16) chunk, moved as 32-bit words (two bf16 / fp16 elements per shuffle).
template <typename T, int E>
__device__ __forceinline__ Chunk<T, E> partner_chunk(const Chunk<T, E>& mine) {
  static_assert(E * sizeof(T) % 4 == 0, "a chunk is a whole number of 32-bit words");
  constexpr int kWords = E * static_cast<int>(sizeof(T)) / 4;
  Chunk<T, E> theirs;
  const uint32_t* const from = reinterpret_cast<const uint32_t*>(&mine);
  uint32_t* const to = reinterpret_cast<uint32_t*>(&theirs);
#pragma unroll
  for (int w = 0; w < kWords; ++w) to[w] = __shfl_xor_sync(kFullMask, from[w], kPartnerLaneXor);
  return theirs;
}

// A chunk's elements in fp32. A bf16 is the top half of an fp32, so each 32-bit word of two bf16 gives its first
// element by a shift and its second by a mask: one instruction per element.
template <typename T, int E>
__device__ __forceinline__ void to_floats(const Chunk<T, E>& c, float (&x)[E]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t* const w = reinterpret_cast<const uint32_t*>(&c);
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = Convert<T>::to_float(c.v[j]);
  }
}

// The norm's factor w (gemma4) or 1 + w (gemma3) in fp32 at element i.
template <typename T>
__device__ __forceinline__ float norm_factor(const void* w, bool fp32, bool gemma4, int i) {
  const float x = fp32 ? static_cast<const float*>(w)[i] : Convert<T>::to_float(static_cast<const T*>(w)[i]);
  return gemma4 ? x : 1.0f + x;
}

// The four factors the producer lane folds into the rotation-table entries of angle i, per tensor: f[i] and
// f[i + D/2].
struct Factors {
  float q_lo, q_hi, k_lo, k_hi;
};

// The head rows of one token: q heads, then K heads, then V heads.
struct TokenRows {
  int hq, hkv;
  __device__ __forceinline__ int count() const { return hq + 2 * hkv; }
};

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

// The first byte of head row h (q heads, then K heads, then V heads) of token t.
template <typename T, int D>
__device__ __forceinline__ const char* row_source(const Params& p, TokenRows r, int t, int h) {
  constexpr long long kRowBytes = D * static_cast<long long>(sizeof(T));
  if (h < r.hq) return static_cast<const char*>(p.q) + (static_cast<long long>(t) * r.hq + h) * kRowBytes;
  if (h < r.hq + r.hkv)
    return static_cast<const char*>(p.k) + (static_cast<long long>(t) * r.hkv + h - r.hq) * kRowBytes;
  return static_cast<const char*>(p.v) + (static_cast<long long>(t) * r.hkv + h - r.hq - r.hkv) * kRowBytes;
}

// Load unit u's rows into a stage (the unit's row i at byte i * kRowBytes), landing on the stage's full
// barrier. Run by the producer warp. The unit's rows [row0, row0 + n) of its token are up to three runs, each
// contiguous in its tensor (q heads, K heads, V heads): with bulk loads lane 0 sets the transaction count and
// lanes 0-2 issue one run's bulk copy each; else lane l copies the unit's 16-byte chunks l, l + 32, ... by
// cp.async and arrives when they land.
template <typename T, int D, int kRowsPerUnit>
__device__ __forceinline__ void load_unit(const Params& p, TokenRows r, long long u, int units_per_token,
                                          uint32_t stage, uint32_t full, int lane) {
  constexpr int kRowBytes = D * static_cast<int>(sizeof(T));
  int t, row0;
  split_unit<kRowsPerUnit>(u, units_per_token, &t, &row0);
  const int n = min(kRowsPerUnit, r.count() - row0);
#if PW_PREPARE_BULK_LOADS
  if (lane == 0) pw_ptx::mbar_arrive_expect_tx(full, static_cast<uint32_t>(n * kRowBytes));
  __syncwarp();
  if (lane < 3) {  // run `lane`: the token's rows [first, last) of its tensor, clipped to the unit
    const int first = max(row0, lane == 0 ? 0 : lane == 1 ? r.hq : r.hq + r.hkv);
    const int last = min(row0 + n, lane == 0 ? r.hq : lane == 1 ? r.hq + r.hkv : r.count());
    if (first < last)
      pw_ptx::bulk_load(stage + (first - row0) * kRowBytes, row_source<T, D>(p, r, t, first),
                        static_cast<uint32_t>((last - first) * kRowBytes), full);
  }
#else
  constexpr int kChunksPerRow = kRowBytes / kCopyBytes;
  for (int c = lane; c < n * kChunksPerRow; c += kWarpSize) {
    const char* const src = row_source<T, D>(p, r, t, row0 + c / kChunksPerRow) + (c % kChunksPerRow) * kCopyBytes;
    pw_ptx::cp_async_16(stage + c * kCopyBytes, src, kCopyBytes);
  }
  pw_ptx::cp_async_mbar_arrive(full);
#endif
}

// Where one unit's rows go, from the plan (the producer finds it and stores it beside the unit's stage).
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

// The rotation table of KV position pos (layout: table_floats), filled by the producer warp: lane l takes the
// angles i = l, l + 32, ... < D/2: float(pos) * inv_freq[i], the fp32 angle the math defines, with its cos and
// sin in fp64 through half-turns (the reduction mod 2 is exact, so no large-argument path and no stack frame at
// any position), rounded to fp32 and multiplied by the lane's factors f[j] of angle l + 32 j.
template <int D>
__device__ __forceinline__ void fill_table(const RopeFreqs<D>& rope, int pos, const Factors (&f)[D / 2 / kWarpSize],
                                           float* table, int lane) {
  constexpr int kHalf = D / 2;
  float* const q_a = table;  // [D] A, then [D] B, for q; the same for k after them
  float* const q_b = q_a + D;
  float* const k_a = q_b + D;
  float* const k_b = k_a + D;
#pragma unroll
  for (int j = 0; j < kHalf / kWarpSize; ++j) {
    const int i = lane + j * kWarpSize;
    const float angle = static_cast<float>(pos) * rope.inv_freq[i];
    const double half_turns = static_cast<double>(angle) * kInvPi;
    const double reduced = half_turns - 2.0 * rint(0.5 * half_turns);  // in [-1, 1]
    double sd, cd;
    sincospi(reduced, &sd, &cd);
    const float c = static_cast<float>(cd), s = static_cast<float>(sd);
    q_a[i] = f[j].q_lo * c;
    q_a[i + kHalf] = f[j].q_hi * c;
    q_b[i] = -f[j].q_hi * s;
    q_b[i + kHalf] = f[j].q_lo * s;
    k_a[i] = f[j].k_lo * c;
    k_a[i + kHalf] = f[j].k_hi * c;
    k_b[i] = -f[j].k_hi * s;
    k_b[i + kHalf] = f[j].k_lo * s;
  }
}

// Wait until the phase with parity `parity` of the mbarrier at `bar` has completed (on sm_90 with the
// pipeline watchdog of sm90_ptx.cuh).
__device__ __forceinline__ void wait_phase(uint32_t bar, uint32_t parity) {
#ifdef PW_SM90_DEVICE_CODE
  pw_ptx::mbar_wait<true>(bar, parity);
#else
  while (!pw_ptx::mbar_probe<false>(bar, parity)) {
  }
#endif
}

// A CTA's shared memory as the two roles see it.
template <int D>
struct Ring {
  uint32_t base;  // shared address of the rows of stage 0
  unsigned char* smem;
  __device__ __forceinline__ uint32_t stage_rows(int s) const { return base + s * kStageBytes; }
  __device__ __forceinline__ float* table(int s) const {
    return reinterpret_cast<float*>(smem + SmemMap<D>::kTables) + s * table_floats<D>();
  }
  __device__ __forceinline__ Unit* unit(int s) const {
    return reinterpret_cast<Unit*>(smem + SmemMap<D>::kUnits + s * kUnitSlotBytes);
  }
  __device__ __forceinline__ uint32_t full(int s) const { return base + SmemMap<D>::kFull + 8 * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return base + SmemMap<D>::kEmpty + 8 * s; }
};

// The work both roles walk: this CTA's units u, u + grid, ... < units.
struct Walk {
  TokenRows r;
  int units_per_token, batch;
  long long first, units, grid;
};

// The producer warp: for each unit, wait until its stage is free, start the rows' copies, look the unit up in
// the plan and write its location and rotation table while they fly, then arrive on the stage's full barrier.
template <typename T, int D>
__device__ __forceinline__ void produce(const Params& p, const RopeFreqs<D>& rope, const Walk& w, const Ring<D>& ring,
                                        int lane) {
  constexpr int kRowsPerUnit = rows_per_unit<T, D>();
  constexpr int kHalf = D / 2;
  Factors f[kHalf / kWarpSize];  // this lane's factors, for every unit's table
  const bool fp32 = p.weight_fp32 != 0, gemma4 = p.norm_style == kGemma4;
#pragma unroll
  for (int j = 0; j < kHalf / kWarpSize; ++j) {
    const int i = lane + j * kWarpSize;
    f[j].q_lo = norm_factor<T>(p.q_weight, fp32, gemma4, i);
    f[j].q_hi = norm_factor<T>(p.q_weight, fp32, gemma4, i + kHalf);
    f[j].k_lo = norm_factor<T>(p.k_weight, fp32, gemma4, i);
    f[j].k_hi = norm_factor<T>(p.k_weight, fp32, gemma4, i + kHalf);
  }
  int s = 0;
  uint32_t phase = 0;
  for (long long u = w.first; u < w.units; u += w.grid) {
    wait_phase(ring.empty(s), phase ^ 1);  // a fresh barrier counts its phase before the first as completed
    load_unit<T, D, kRowsPerUnit>(p, w.r, u, w.units_per_token, ring.stage_rows(s), ring.full(s), lane);
    const Unit a = locate<D, kRowsPerUnit>(p, w.r, u, w.units_per_token, w.batch);
    if (lane == 0) *ring.unit(s) = a;
    if (a.valid()) fill_table<D>(rope, a.pos, f, ring.table(s), lane);
    pw_ptx::mbar_arrive(ring.full(s));
    if (++s == kStages) s = 0, phase ^= 1;
  }
#if !PW_PREPARE_BULK_LOADS
  pw_ptx::cp_async_wait_all();  // leave no copy in flight behind an exiting thread (bulk copies land on `full`)
#endif
}

// One consumer warp's share of a unit: its rows warp, warp + 8, ... in three passes over all of them (loads and
// squares, the butterfly sums, then norm, RoPE and store), so the rows' shuffles and loads overlap. (The rows
// stay in the stage between the passes: reading them twice costs less than holding them.)
template <typename T, int D>
__device__ __forceinline__ void normalise_and_rotate(const Params& p, TokenRows r, const Unit& cur, const T* stage,
                                                     const float* unit_table, int warp, int lane) {
  constexpr int E = D / kWarpSize;  // elements per lane
  constexpr int kRowsPerUnit = rows_per_unit<T, D>();
  constexpr int kRowsPerWarp = kRowsPerUnit / kConsumerWarps;
  using Row = Chunk<T, E>;
  const int c0 = lane * E;  // this lane's first element of a row
  const bool gemma4 = p.norm_style == kGemma4;
  const int rows = min(kRowsPerUnit, r.count() - cur.row0);
  // This lane's chunk of the warp's first row in the stage; row warp + b * 8 is b * 8 * D on.
  const T* const warp_rows = stage + warp * D + c0;
  float sum_sq[kRowsPerWarp];
#pragma unroll
  for (int b = 0; b < kRowsPerWarp; ++b) {
    const int lr = warp + b * kConsumerWarps;  // warp-uniform
    sum_sq[b] = 0.0f;
    if (lr < rows) {
      float x[E];
      to_floats<T, E>(*reinterpret_cast<const Row*>(warp_rows + b * kConsumerWarps * D), x);
#pragma unroll
      for (int j = 0; j < E; ++j) sum_sq[b] += x[j] * x[j];
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
    const int lr = warp + b * kConsumerWarps;
    if (lr >= rows) break;
    const int h = cur.row0 + lr;
    const bool is_q = h < r.hq, is_v = h >= r.hq + r.hkv;
    Row* const dst = reinterpret_cast<Row*>(is_q   ? q_out + h * D
                                            : is_v ? v_slot + (h - r.hq - r.hkv) * D
                                                   : k_slot + (h - r.hq) * D);
    const Row raw = *reinterpret_cast<const Row*>(warp_rows + b * kConsumerWarps * D);
    if (is_v && !gemma4) {  // gemma3: V is written as given
      *dst = raw;
      continue;
    }
    const float inv_rms = rsqrtf(sum_sq[b] / static_cast<float>(D) + p.eps);
    Row y;
    float x[E];
    to_floats<T, E>(raw, x);
    if (is_v) {
#pragma unroll
      for (int j = 0; j < E; ++j) y.v[j] = Convert<T>::from_float(x[j] * inv_rms);
    } else {  // warp-uniform branch: every lane of the warp shuffles with its partner
      float xp[E];
      to_floats<T, E>(partner_chunk<T, E>(raw), xp);
      const float* const rot_a = unit_table + (is_q ? 0 : 2 * D) + c0;  // A, then B D floats later
      const float* const rot_b = rot_a + D;
#pragma unroll
      for (int j = 0; j < E; ++j) y.v[j] = Convert<T>::from_float((x[j] * rot_a[j] + xp[j] * rot_b[j]) * inv_rms);
    }
    *dst = y;
  }
}

// A consumer warp: for each unit, wait for its stage, normalise, rotate and store its share of the rows, then
// hand the stage back (one arrive per thread).
template <typename T, int D>
__device__ __forceinline__ void consume(const Params& p, const Walk& w, const Ring<D>& ring, int warp, int lane) {
  const T* const rows = reinterpret_cast<const T*>(ring.smem);
  int s = 0;
  uint32_t phase = 0;
  for (long long u = w.first; u < w.units; u += w.grid) {
    wait_phase(ring.full(s), phase);
    const Unit cur = *ring.unit(s);
    if (cur.valid())
      normalise_and_rotate<T, D>(p, w.r, cur, rows + s * (kStageBytes / sizeof(T)), ring.table(s), warp, lane);
    pw_ptx::mbar_arrive(ring.empty(s));
    if (++s == kStages) s = 0, phase ^= 1;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, min_blocks_per_sm<D>())
    pw_prepare_qkv_kernel(const Params p, const __grid_constant__ RopeFreqs<D> rope) {
  constexpr int kRowsPerUnit = rows_per_unit<T, D>();
  static_assert(D / 2 % kWarpSize == 0, "the producer's lanes share the angles evenly");
  static_assert(kRowsPerUnit % kConsumerWarps == 0, "the consumer warps share a unit's rows evenly");
  static_assert(sizeof(Unit) <= kUnitSlotBytes, "a unit fits its slot");
  extern __shared__ __align__(128) unsigned char smem[];

  const int total = min(p.plan_scalars[1], p.token_capacity);
  const int batch = min(p.plan_scalars[0], p.batch_capacity);
  if (total <= 0 || batch <= 0) return;
  const TokenRows r{p.num_qo_heads, p.num_kv_heads};
  const int units_per_token = (r.count() + kRowsPerUnit - 1) / kRowsPerUnit;
  const Walk w{r, units_per_token, batch, blockIdx.x, static_cast<long long>(total) * units_per_token, gridDim.x};
  if (w.first >= w.units) return;

  const Ring<D> ring{pw_ptx::smem_addr(smem), smem};
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      pw_ptx::mbar_init(ring.full(s), kFullArrivals);
      pw_ptx::mbar_init(ring.empty(s), kEmptyArrivals);
    }
#if PW_PREPARE_BULK_LOADS
    pw_ptx::mbar_init_fence();  // the bulk copies (the async proxy) complete on them
#endif
  }
  __syncthreads();

  // The warp index broadcast from lane 0, so that the compiler knows it is warp-uniform (the roles' and the
  // rows' branches then need no reconvergence).
  const int warp = __shfl_sync(kFullMask, static_cast<int>(threadIdx.x / kWarpSize), 0);
  const int lane = threadIdx.x % kWarpSize;
  if (warp == kProducerWarp) produce<T, D>(p, rope, w, ring, lane);
  else consume<T, D>(p, w, ring, warp, lane);
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
  constexpr int bytes = SmemMap<D>::kBytes;
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
static int launch(const Params& p, const float* inv_freq, cudaStream_t stream) {
  int device = 0, ctas = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return static_cast<int>(e);
  const int rc = resident_ctas<T, D>(device, &ctas);
  if (rc != 0) return rc;
  constexpr int kRowsPerUnit = rows_per_unit<T, D>();
  const long long units_per_token = (p.num_qo_heads + 2LL * p.num_kv_heads + kRowsPerUnit - 1) / kRowsPerUnit;
  const long long capacity_units = units_per_token * p.token_capacity;
  const unsigned grid = static_cast<unsigned>(capacity_units < ctas ? capacity_units : ctas);
  RopeFreqs<D> rope;
  for (int i = 0; i < D / 2; ++i) rope.inv_freq[i] = inv_freq[i];
  pw_prepare_qkv_kernel<T, D><<<grid, kThreads, SmemMap<D>::kBytes, stream>>>(p, rope);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
static int launch_for_head_dim(const Params& p, int head_dim, const float* inv_freq, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch<T, 64>(p, inv_freq, stream);
    case 128: return launch<T, 128>(p, inv_freq, stream);
    case 256: return launch<T, 256>(p, inv_freq, stream);
    default: return launch<T, 512>(p, inv_freq, stream);
  }
}

}  // namespace pw_prepare

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

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a->dtype) {
    case 0: return launch_for_head_dim<__nv_bfloat16>(p, head_dim, a->inv_freq, s);
    case 1: return launch_for_head_dim<__half>(p, head_dim, a->inv_freq, s);
    default: return launch_for_head_dim<float>(p, head_dim, a->inv_freq, s);
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
