// pagedwindow: windowed paged attention for tiles of 16 packed query rows (decode and other short requests),
// head_dim 256, bf16 in/out, split-KV. Both prefill launchers hand cta_tile_q 16 to this kernel.
//
// Semantics: those of prefill_hd256.cu (docs/design.md §2): query row j of request r sits at KV position
// q_pos = kv_len_r - seq_r + j; key k is visible iff k <= q_pos and (window_left < 0 or q_pos - k <= window_left);
// fp32 logits, softmax and accumulation; output cast once to bf16; optional natural-log LSE per (row, q head).
//
// Why a kernel of its own: a decode step is memory-bound (each K/V byte of the window is used by one token's
// group of query heads), so what matters is reading every K/V byte once with enough bytes in flight, and
// keeping every SM busy when batch x KV heads is small. A 64- or 128-row prefill tile computes 32-64x more padding
// than a decode request has rows.
//
// Work: a unit is (tile, KV head, split). A tile's visible keys [kv_lo, kv_hi) are cut into `splits` equal runs of
// 16-key steps; `splits` is uniform over the launch and chosen on the device from the live tile count, so a
// captured CUDA graph stays right after an in-place plan update:
//   items = num_tiles * num_kv_heads; splits = clamp(workspace_units / items, 1, kMaxSplits)
// (a tile whose keys are too few for that many splits of kMinStepsPerSplit steps uses fewer). The grid is
// persistent: CTA c runs units c, c + grid, ... A unit of an unsplit tile writes its rows to `out`; a split unit
// writes its normalised partial rows and their log2-domain LSE to the workspace (partials [units][16][256], then
// LSEs [16][units], so that a row's LSEs of consecutive splits sit side by side), and the tile's splits are merged
// as out = sum_s w_s O_s / sum_s w_s with w_s = exp2(lse_s - max lse): a tile of at most kGridMergeMaxSplits
// splits by the last of them to finish (a counter per tile, reset by that split; merge_splits), a tile of more by
// pw_decode_merge_kernel, a grid the launch runs after this one when the plan's capacity allows such tiles.
//
// CTA = one warp (so 4 CTAs share an SM on H100/H200 and an SM never waits on a CTA-wide barrier). The warp
// owns the tile's 16 packed rows (row r = token r / group, head-in-group r % group; rows past the tile's are zero
// and never written) and streams its keys 16 at a time through kStages shared-memory stages of K and V filled by
// cp.async (zero-filled outside [kv_lo, kv_hi), so no unowned slot is ever read). Per step: S = Q K^T
// (16 x 16, mma.sync m16n8k16, Q re-read from shared memory), the boundary mask and online softmax of
// online_softmax.cuh (kN = 2), O += P V (16 x 256). Shared memory rows are 512 bytes, 16-byte chunks
// XOR-swizzled by (row & 7), as in prefill_hd256.cu.
//
// Plain CUDA C++, no torch headers. Targets: sm_80, sm_89, sm_90a.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <atomic>

#include "decode_trace.cuh"    // the per-CTA timeline of a -DPW_DECODE_TRACE=1 build (no code otherwise)
#include "online_softmax.cuh"  // the boundary mask and online-softmax step (16 rows x 8 kN keys)
#include "prefill_launch.cuh"  // status codes, PwPrefillParams
#include "ptx_common.cuh"      // cp.async, ldmatrix, mma.sync, bf16 packing

namespace pw_decode {

using namespace pw_ptx;
using Params = PwPrefillParams;

constexpr int kHeadDim = kPwPrefillHeadDim;
constexpr int kRows = 16;                      // packed query rows of a tile (cta_tile_q)
constexpr int kSteps = 16;                     // keys per step
constexpr int kRowBytes = kHeadDim * 2;        // 512 bytes per bf16 row
constexpr int kTileBytes = kRows * kRowBytes;  // 8 KiB: the Q tile, one step's K, one step's V
#ifndef PW_DECODE_STAGES
#define PW_DECODE_STAGES 3
#endif
constexpr int kStages = PW_DECODE_STAGES;  // K/V steps a warp holds: kStages - 1 in flight while it computes one
constexpr int kSmemBytes = (1 + 2 * kStages) * kTileBytes;  // Q | K[kStages] | V[kStages]: 56 KiB at 3 stages
constexpr int kThreads = 32;
#ifndef PW_DECODE_MAX_SPLITS
#define PW_DECODE_MAX_SPLITS 64
#endif
#ifndef PW_DECODE_MIN_STEPS_PER_SPLIT
#define PW_DECODE_MIN_STEPS_PER_SPLIT 2
#endif
constexpr int kMaxSplits = PW_DECODE_MAX_SPLITS;  // splits of one tile's keys at most
// A split covers at least this many steps (2: 32 keys; else the merge costs more than it saves).
constexpr int kMinStepsPerSplit = PW_DECODE_MIN_STEPS_PER_SPLIT;
constexpr int kPartialFloats = kRows * kHeadDim;  // one unit's partial rows in the workspace
constexpr int kWeightSlots = 2 * 32;              // a row's merge weights in shared memory: two splits per lane
static_assert(kMaxSplits >= 1 && kMaxSplits <= kWeightSlots, "splits of a tile: 1 .. two per lane");
static_assert(kMinStepsPerSplit >= 1, "a split covers at least one step");
// A tile of at most this many splits is merged inside the decode grid by its last split (two merge batches at
// most, which overlap the other units' tail); a tile of more, by pw_decode_merge_kernel after the grid when the
// launch runs it (`merge_after`), since one warp reading many splits' partials is the grid's longest chain. The
// break-even on an H100: 16-split tiles lost 1.7 % merged after the grid, 32-split tiles gained 17 % (run 137).
constexpr int kGridMergeMaxSplits = 16;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLn2 = 0.69314718055994530942f;

// Byte offset of 16-byte chunk `chunk` (0..31) of row `row` in a swizzled 512-byte-row tile.
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

// What one tile reads and writes (uniform across the warp).
struct Tile {
  int qo_begin;                                  // the request's first token
  int row0;                                      // first packed row of the tile
  int rows;                                      // packed rows the tile owns (1..16)
  int q_shift;                                   // q_pos = q_shift + token in the request
  int page_base, kv_lo, kv_hi, kv_start, steps;  // keys [kv_lo, kv_hi); steps of 16 from kv_start
};

__device__ __forceinline__ Tile tile_geometry(const Params& p, int tile) {
  Tile t;
  const int req = p.request_indices[tile];
  const int qtile = p.qo_tile_indices[tile];
  t.qo_begin = p.qo_indptr[req];
  const int seq = p.qo_indptr[req + 1] - t.qo_begin;
  t.page_base = p.page_indptr[req];
  const int kv_len = (p.page_indptr[req + 1] - t.page_base - 1) * p.page_size + p.last_page_len[req];
  t.row0 = qtile * kRows;
  t.rows = min(kRows, seq * p.group - t.row0);
  t.q_shift = kv_len - seq;
  const int qpos_first = t.q_shift + t.row0 / p.group;
  const int qpos_last = t.q_shift + (t.row0 + max(t.rows, 1) - 1) / p.group;
  t.kv_lo = p.window_left >= 0 ? max(qpos_first - p.window_left, 0) : 0;
  t.kv_hi = min(qpos_last + 1, kv_len);
  t.kv_start = t.kv_lo & ~(kSteps - 1);
  t.steps = (t.rows > 0 && t.kv_hi > t.kv_start) ? (t.kv_hi - t.kv_start + kSteps - 1) / kSteps : 0;
  return t;
}

// The (token, q head) a packed row of the tile stands for, as an element offset of its [256] row in q / out.
__device__ __forceinline__ long long row_offset(const Params& p, const Tile& t, int kv_head, int r) {
  const int pr = t.row0 + r;
  const int tok = pr / p.group;
  const int head = kv_head * p.group + (pr - tok * p.group);
  return (static_cast<long long>(t.qo_begin + tok) * p.num_qo_heads + head) * kHeadDim;
}

// Lane l < 16: the pool element offset of key kb + l's row for this KV head, or -1 outside [kv_lo, kv_hi).
__device__ __forceinline__ long long key_offset(const Params& p, const Tile& t, int kv_head, int kb, int lane) {
  const int key = kb + lane;
  if (lane >= kSteps || key < t.kv_lo || key >= t.kv_hi) return -1;
  const int pi = key / p.page_size;
  const int slot = key - pi * p.page_size;
  const int page = __ldg(p.page_indices + t.page_base + pi);
  return static_cast<long long>(page) * p.page_stride +
         static_cast<long long>(slot * p.num_kv_heads + kv_head) * kHeadDim;
}

// Copy one step's 16 K rows and 16 V rows (row offsets in lanes 0-15 of `off`); lane l copies chunk l of each.
__device__ __forceinline__ void issue_step(const Params& p, long long off, uint32_t s_k, uint32_t s_v, int lane) {
  const __nv_bfloat16* k_lane = p.pool + p.k_offset + lane * 8;
  const __nv_bfloat16* v_lane = p.pool + p.v_offset + lane * 8;
#pragma unroll
  for (int r = 0; r < kSteps; ++r) {
    const long long row = __shfl_sync(kFullMask, off, r);
    const bool valid = row >= 0;
    cp_async_16(s_k + swz(r, lane), valid ? static_cast<const void*>(k_lane + row) : p.pool, valid ? 16 : 0);
    cp_async_16(s_v + swz(r, lane), valid ? static_cast<const void*>(v_lane + row) : p.pool, valid ? 16 : 0);
  }
}

// Splits of each tile's keys this launch (uniform), from the live tile count.
__device__ __forceinline__ int launch_splits(const Params& p, int items) {
  if (p.workspace_units <= 0 || items <= 0) return 1;
  return max(1, min(kMaxSplits, p.workspace_units / items));
}

// A tile's splits: the launch's, at most one per kMinStepsPerSplit steps, at least 1. The decode grid and the
// merge kernel must agree on it. (Fewer splits for tiles of many rows, which write and merge more partial rows,
// were slower: a one-warp unit's steps are bound by the bytes one warp moves, run 159.)
__device__ __forceinline__ int tile_split_count(int splits, const Tile& t) {
  return max(1, min(splits, t.steps / kMinStepsPerSplit));
}

// One row's split weights from its splits' log2-domain LSEs, lane s holding splits s and s + 32 (-inf past the
// tile's splits): w_s / sum w for each, and the row's natural-log LSE. A split that saw none of the row's keys
// has LSE -inf and weight exp2(-inf) = 0; no key at all: max -inf, every weight 0, LSE -inf.
struct SplitWeights {
  float a, b;  // lane s: split s's and split s + 32's normalised weight
  float lse;   // the row's natural-log LSE
};

__device__ __forceinline__ SplitWeights split_weights(float lse_a, float lse_b) {
  float mx = fmaxf(lse_a, lse_b);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
  const float w_a = mx == -INFINITY ? 0.f : fast_exp2(lse_a - mx);
  const float w_b = mx == -INFINITY ? 0.f : fast_exp2(lse_b - mx);
  float total = w_a + w_b;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(kFullMask, total, o);
  const float inv = total > 0.f ? 1.f / total : 0.f;
  return {w_a * inv, w_b * inv, total > 0.f ? (mx + __log2f(total)) * kLn2 : -INFINITY};
}

// Merge the `splits` (<= kMaxSplits) partials of workspace units [first, first + splits) into the tile's output
// rows. One warp reads every partial row from L2 at the end of the launch, and its time goes with the sectors it
// asks for (the decode trace: about 0.9 us per batch of 8 splits x 2 rows when each load instruction touched
// twice the sectors it used), so every load of the warp reads whole contiguous sectors:
//   1. Every row's split LSEs at once (lanes s and s + 32 hold split s and s + 32 of each row, side by side in
//      the LSE block: one trip); per row a warp-wide max and sum give each split's normalised weight
//      w_s / sum w, kept in shared memory `weights [kRows][kWeightSlots]`, and the row's LSE.
//   2. Rows kMergeRows at a time: each lane sums its 8 columns over the splits, 4 lane .. 4 lane + 3 and
//      128 + 4 lane .. 128 + 4 lane + 3 (each of the warp's float4 loads reads 512 contiguous bytes of a row),
//      kMergeUnroll splits' loads of every row of the group in flight at once.
// The order of every sum is fixed, so the result does not depend on which split finished last.
constexpr int kMergeRows = 2;    // rows whose columns are summed together (a decode token's rows at group 2)
constexpr int kMergeUnroll = 8;  // splits whose loads a lane keeps in flight per row: 2 x 8 x 8 floats

__device__ __forceinline__ void merge_splits(const Params& p, const Tile& t, int kv_head, int first, int splits,
                                             float* weights, int lane, DecodeTrace& trace, bool traced) {
  static_assert(kRows * kWeightSlots * sizeof(float) <= kStages * kTileBytes, "the weights fit the K stages");
  const float* lse_base = p.workspace + static_cast<long long>(p.workspace_units) * kPartialFloats;
  float lse_a[kRows], lse_b[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float* row_lse = lse_base + static_cast<long long>(r) * p.workspace_units + first;
    const bool row = r < t.rows;
    lse_a[r] = row && lane < splits ? __ldcg(row_lse + lane) : -INFINITY;
    lse_b[r] = row && lane + 32 < splits ? __ldcg(row_lse + lane + 32) : -INFINITY;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= t.rows) break;  // uniform
    const SplitWeights w = split_weights(lse_a[r], lse_b[r]);
    weights[r * kWeightSlots + lane] = w.a;
    weights[r * kWeightSlots + lane + 32] = w.b;
    if (p.lse != nullptr && lane == 0) p.lse[row_offset(p, t, kv_head, r) / kHeadDim] = w.lse;
  }
  __syncwarp();  // every row's weights written
  trace.clock(traced, kSlotMergeWeights);

  // Loads are never predicated, so that the compiler issues a whole chunk's at once: a split past `splits` reads
  // the last split's (finite) partial with weight 0, and a row past the tile's reads its last row, never stored.
  for (int r0 = 0; r0 < t.rows; r0 += kMergeRows) {
    float acc[kMergeRows][8];
#pragma unroll
    for (int h = 0; h < kMergeRows; ++h)
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[h][c] = 0.f;
    for (int s0 = 0; s0 < splits; s0 += kMergeUnroll) {
#pragma unroll
      for (int j = 0; j < kMergeUnroll; ++j) {
        const int s = min(s0 + j, splits - 1);
        const float* src_split = p.workspace + static_cast<long long>(first + s) * kPartialFloats + lane * 4;
#pragma unroll
        for (int h = 0; h < kMergeRows; ++h) {
          const int r = min(r0 + h, t.rows - 1);
          const float w = s0 + j < splits ? weights[r * kWeightSlots + s] : 0.f;
          const float4* src = reinterpret_cast<const float4*>(src_split + r * kHeadDim);
          const float4 a = __ldcg(src), b = __ldcg(src + 32);  // columns 4 lane + (0..3), 128 + 4 lane + (0..3)
          acc[h][0] += w * a.x, acc[h][1] += w * a.y, acc[h][2] += w * a.z, acc[h][3] += w * a.w;
          acc[h][4] += w * b.x, acc[h][5] += w * b.y, acc[h][6] += w * b.z, acc[h][7] += w * b.w;
        }
      }
      trace.clock(traced && r0 == 0 && s0 == 0, kSlotMergeBatch);
    }
#pragma unroll
    for (int h = 0; h < kMergeRows; ++h) {
      if (r0 + h < t.rows) {
        __nv_bfloat16* const dst = p.out + row_offset(p, t, kv_head, r0 + h) + lane * 4;
        *reinterpret_cast<uint2*>(dst) =
            make_uint2(pack_bf16x2(acc[h][0], acc[h][1]), pack_bf16x2(acc[h][2], acc[h][3]));
        *reinterpret_cast<uint2*>(dst + 128) =
            make_uint2(pack_bf16x2(acc[h][4], acc[h][5]), pack_bf16x2(acc[h][6], acc[h][7]));
      }
    }
  }
  trace.clock(traced, kSlotMergeRows);
  __syncwarp();  // every lane done with the weights before the next unit's copies reuse the stages
}

__global__ void __launch_bounds__(kThreads) pw_decode_hd256_kernel(const Params p, const bool merge_after) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = smem_addr(smem);
  const uint32_t sK = sQ + kTileBytes;
  const uint32_t sV = sK + kStages * kTileBytes;
  const int lane = threadIdx.x;
  DecodeTrace trace;  // records in a -DPW_DECODE_TRACE=1 build only
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A merge grid launched after this one may start now (its griddepcontrol.wait still waits for this whole grid).
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif

  const int num_tiles = p.plan_scalars[2];
  const int items = num_tiles * p.num_kv_heads;
  const int splits = launch_splits(p, items);
  const int units = items * splits;

  // Per-lane fragment addressing (prefill_hd256.cu's, for one warp and 16-key steps).
  const int g = lane >> 2;  // accumulator row (and g + 8)
  const int c4 = lane & 3;  // accumulator column pair
  const int l7 = lane & 7;
  const int b3 = (lane >> 3) & 1;
  const int b4 = (lane >> 4) & 1;
  uint32_t q_off[4], k_off[4], v_off[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    q_off[i] = sQ + (lane & 15) * kRowBytes + (((2 * i) ^ (b4 ^ l7)) << 4);  // A: row lane & 15, chunk 2kk + b4
    k_off[i] = (b4 * 8 + l7) * kRowBytes + (((2 * i) ^ (b3 ^ l7)) << 4);     // B: key 8 b4 + l7, chunk 2kk + b3
    v_off[i] = (b3 * 8 + l7) * kRowBytes + (((2 * i) ^ (b4 ^ l7)) << 4);     // B (trans): key 8 b3 + l7
  }
  const float sl2 = p.scale_log2;

  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const int item = u / splits;
    const int split = u - item * splits;
    const int tile = item / p.num_kv_heads;
    const int kv_head = item - tile * p.num_kv_heads;
    const Tile t = tile_geometry(p, tile);
    if (t.rows <= 0) continue;  // uniform: a tile past its request's rows (never laid out by a plan)
    // This tile's splits (tile_split_count); units of splits past that do nothing.
    const int tile_splits = tile_split_count(splits, t);
    if (split >= tile_splits) continue;
    const int per = (t.steps + tile_splits - 1) / tile_splits;
    const int j0 = min(t.steps, split * per);
    const int n = min(t.steps, j0 + per) - j0;  // this unit's steps
    const bool first = trace.unit();            // the trace records the CTA's first unit
    trace.clock(first, kSlotReady);
    trace.value(first, kSlotFirstUnit, u + 1);
    trace.value(first, kSlotSteps, n);

    // ---- Q (rows past the tile's zero-filled) and the first kStages - 1 steps. Lane r < t.rows locates packed row
    // r once (its token and head take a division by the group) and the loops over rows read it by shuffle, so a
    // 16-row tile pays one division in parallel instead of sixteen one after another.
    const long long my_row = lane < t.rows ? row_offset(p, t, kv_head, lane) : 0;
#pragma unroll 4
    for (int r = 0; r < kRows; ++r) {
      const long long row = __shfl_sync(kFullMask, my_row, r);
      const bool valid = r < t.rows;
      const void* src = valid ? static_cast<const void*>(p.q + row + lane * 8) : p.q;
      cp_async_16(sQ + swz(r, lane), src, valid ? 16 : 0);
    }
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n) {
        const long long off = key_offset(p, t, kv_head, t.kv_start + (j0 + s) * kSteps, lane);
        issue_step(p, off, sK + s * kTileBytes, sV + s * kTileBytes, lane);
      }
      cp_async_commit();
    }
    long long next_off =
        kStages - 1 < n ? key_offset(p, t, kv_head, t.kv_start + (j0 + kStages - 1) * kSteps, lane) : -1;

    // ---- per-thread rows g and g + 8: their KV positions and window edges
    const int qp0 = t.q_shift + (t.row0 + g) / p.group;
    const int qp1 = t.q_shift + (t.row0 + g + 8) / p.group;
    const int wl = p.window_left;
    const int lo0 = wl >= 0 ? qp0 - wl : 0;
    const int lo1 = wl >= 0 ? qp1 - wl : 0;
    const int qpos_first = t.q_shift + t.row0 / p.group;
    const int qpos_last = t.q_shift + (t.row0 + t.rows - 1) / p.group;

    float o[32][4];
#pragma unroll
    for (int d = 0; d < 32; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    pw_softmax::OnlineSoftmax softmax;  // rows g and g + 8: running max and row sums

    for (int i = 0; i < n; ++i) {
      cp_async_wait<kStages - 2>();  // step i (and Q) landed
      __syncwarp();                  // every lane's copies, and every lane is done with step i - 1's stage
      trace.clock(first && i == 0, kSlotLanded);
      trace.clock(first && i == 1, kSlotSecondStep);
      {
        const int ahead = i + kStages - 1;  // into the stage step i - 1 used
        if (ahead < n) {
          const int st = ahead % kStages;
          issue_step(p, next_off, sK + st * kTileBytes, sV + st * kTileBytes, lane);
          next_off = ahead + 1 < n ? key_offset(p, t, kv_head, t.kv_start + (j0 + ahead + 1) * kSteps, lane) : -1;
        }
        cp_async_commit();
      }
      const int kb = t.kv_start + (j0 + i) * kSteps;
      const uint32_t kbuf = sK + (i % kStages) * kTileBytes;
      const uint32_t vbuf = sV + (i % kStages) * kTileBytes;

      // S = Q K^T: s[0] keys kb .. kb + 7, s[1] keys kb + 8 .. kb + 15
      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < 16; ++kk) {
        uint32_t a0, a1, a2, a3, k0, k1, k2, k3;
        ldsm_x4(a0, a1, a2, a3, q_off[kk & 3] + (kk >> 2) * 128);
        ldsm_x4(k0, k1, k2, k3, kbuf + k_off[kk & 3] + (kk >> 2) * 128);
        mma_bf16_16816(s[0], a0, a1, a2, a3, k0, k1);
        mma_bf16_16816(s[1], a0, a1, a2, a3, k2, k3);
      }
      auto at = [&](int nn, int e) -> float& { return s[nn][e]; };
      const bool full = (kb + kSteps - 1 <= qpos_first) && (wl < 0 || kb >= qpos_last - wl) && kb >= t.kv_lo &&
                        kb + kSteps <= t.kv_hi;
      if (!full) pw_softmax::mask_tile<2>(at, kb, c4, lo0, qp0, lo1, qp1);
      float alpha0, alpha1;
      softmax.step<2>(at, sl2, alpha0, alpha1);
#pragma unroll
      for (int d = 0; d < 32; ++d) {
        o[d][0] *= alpha0;
        o[d][1] *= alpha0;
        o[d][2] *= alpha1;
        o[d][3] *= alpha1;
      }
      const uint32_t p0 = pack_bf16x2(s[0][0], s[0][1]);  // row g,   keys 2c4, 2c4 + 1
      const uint32_t p1 = pack_bf16x2(s[0][2], s[0][3]);  // row g+8, keys 2c4, 2c4 + 1
      const uint32_t p2 = pack_bf16x2(s[1][0], s[1][1]);  // row g,   keys 8 + 2c4, 8 + 2c4 + 1
      const uint32_t p3 = pack_bf16x2(s[1][2], s[1][3]);  // row g+8, keys 8 + 2c4, 8 + 2c4 + 1
                                                          // O += P V: o[d] covers head dims 8d .. 8d + 7
#pragma unroll
      for (int dp = 0; dp < 16; ++dp) {
        uint32_t v0, v1, v2, v3;
        ldsm_x4_trans(v0, v1, v2, v3, vbuf + v_off[dp & 3] + (dp >> 2) * 128);
        mma_bf16_16816(o[2 * dp], p0, p1, p2, p3, v0, v1);
        mma_bf16_16816(o[2 * dp + 1], p0, p1, p2, p3, v2, v3);
      }
    }
    cp_async_wait<0>();
    __syncwarp();  // no copy still landing; every lane done with the stages and Q
    trace.clock(first, kSlotLoopEnd);

    float inv0, inv1;
    softmax.finalize(inv0, inv1);

    if (tile_splits == 1) {
      // ---- the whole tile in this unit: stage the rows as bf16 in Q's place, copy out 16 B per lane
      store_acc_rows_bf16(sQ, 0, o, inv0, inv1, g, c4);
      __syncwarp();
      if (p.lse != nullptr && c4 == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = g + 8 * h;
          if (r < t.rows) p.lse[row_offset(p, t, kv_head, r) / kHeadDim] = softmax.lse(h);
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const long long row = __shfl_sync(kFullMask, my_row, r);
        if (r < t.rows) {  // uniform
          const uint4 v = ld_shared_v4(sQ + swz(r, lane));
          *reinterpret_cast<uint4*>(p.out + row + lane * 8) = v;
        }
      }
      trace.clock(first, kSlotStored);
      __syncwarp();  // the next unit's Q copies land where these rows were staged
      continue;
    }

    // ---- a split: normalised partial rows and their log2-domain LSE to the workspace (row r's at [r][u])
    float* const part = p.workspace + static_cast<long long>(u) * kPartialFloats;
    float* const part_lse = p.workspace + static_cast<long long>(p.workspace_units) * kPartialFloats + u;
#pragma unroll
    for (int d = 0; d < 32; ++d) {
      if (g < t.rows)
        __stcg(reinterpret_cast<float2*>(part + g * kHeadDim + 8 * d + 2 * c4),
               make_float2(o[d][0] * inv0, o[d][1] * inv0));
      if (g + 8 < t.rows)
        __stcg(reinterpret_cast<float2*>(part + (g + 8) * kHeadDim + 8 * d + 2 * c4),
               make_float2(o[d][2] * inv1, o[d][3] * inv1));
    }
    if (c4 == 0) {
      if (g < t.rows) __stcg(part_lse + static_cast<long long>(g) * p.workspace_units, softmax.lse_log2(0));
      if (g + 8 < t.rows) __stcg(part_lse + static_cast<long long>(g + 8) * p.workspace_units, softmax.lse_log2(1));
    }
    trace.clock(first, kSlotStored);
    if (merge_after && tile_splits > kGridMergeMaxSplits) continue;  // pw_decode_merge_kernel merges the tile
    // The counter: lane 0's release carries the whole warp's partial (ordered before it by __syncwarp) to the
    // split that acquires the last count; that split's lanes read the others' partials after lane 0's acquire
    // (ordered by the __syncwarp after the shuffle).
    __syncwarp();
    int arrived = 0;
    if (lane == 0) arrived = atomic_add_acq_rel_gpu(p.split_counters + item, 1);
    arrived = __shfl_sync(kFullMask, arrived, 0);
    trace.clock(first, kSlotArrived);
    if (arrived == tile_splits - 1) {  // the last split of this tile: every other partial is written
      __syncwarp();
      merge_splits(p, t, kv_head, item * splits, tile_splits, reinterpret_cast<float*>(smem + kTileBytes), lane, trace,
                   first);
      if (lane == 0) p.split_counters[item] = 0;  // ready for the next launch (or graph replay)
      trace.clock(first, kSlotMergeEnd);
      trace.value(first, kSlotMerged, 1);
    }
  }
  trace.exit();
}

// The merge of the tiles of more than kGridMergeMaxSplits splits, a grid of its own launched after the decode
// kernel on the same stream (by programmatic dependent launch on sm_90, so that its launch and prologue overlap the
// decode grid). CTA = (tile, KV head) of the plan's tile capacity, kMergeThreads threads: warp w sums row
// r0 + w / 4's columns 64 (w % 4) + 2 lane, + 1 over the tile's splits, for r0 = 0, 2, 4, ... < rows; a lane's
// loads of 32 splits and its row's split LSEs go out together. The weights and the order of every sum are
// merge_splits', so the output bits do not depend on which grid merged a tile.
constexpr int kMergeThreads = 256;
constexpr int kMergeKernelUnroll = 32;  // splits whose float2 loads a lane keeps in flight

__global__ void __launch_bounds__(kMergeThreads, 1) pw_decode_merge_kernel(const Params p) {
  const int tile = static_cast<int>(blockIdx.x) / p.num_kv_heads;
  const int kv_head = static_cast<int>(blockIdx.x) - tile * p.num_kv_heads;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int num_tiles = p.plan_scalars[2];
  if (tile >= num_tiles) return;  // past the live tiles of a plan filled below its capacity
  const int items = num_tiles * p.num_kv_heads;
  const int splits = launch_splits(p, items);
  const Tile t = tile_geometry(p, tile);
  const int tile_splits = tile_split_count(splits, t);
  if (t.rows <= 0 || tile_splits <= kGridMergeMaxSplits) return;  // written or merged by the decode grid
  const int first = (tile * p.num_kv_heads + kv_head) * splits;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the decode grid done, its partials visible
#endif
  const float* lse_base = p.workspace + static_cast<long long>(p.workspace_units) * kPartialFloats;
  const int col = (warp % 4) * 64 + 2 * lane;
  for (int r0 = 0; r0 < t.rows; r0 += 2) {
    const int r = r0 + warp / 4;
    if (r >= t.rows) break;  // uniform over the warp
    // The first kMergeKernelUnroll splits' columns, issued before the LSEs so that the two trips overlap.
    const float* src_row = p.workspace + static_cast<long long>(first) * kPartialFloats + r * kHeadDim + col;
    float2 v[kMergeKernelUnroll];
    auto load_splits = [&](int s0) {
#pragma unroll
      for (int j = 0; j < kMergeKernelUnroll; ++j) {  // never predicated: a split past the count reads the last
        const int s = min(s0 + j, tile_splits - 1);
        v[j] = __ldcg(reinterpret_cast<const float2*>(src_row + static_cast<long long>(s) * kPartialFloats));
      }
    };
    load_splits(0);
    const float* row_lse = lse_base + static_cast<long long>(r) * p.workspace_units + first;
    const float lse_a = lane < tile_splits ? __ldcg(row_lse + lane) : -INFINITY;
    const float lse_b = lane + 32 < tile_splits ? __ldcg(row_lse + lane + 32) : -INFINITY;
    const SplitWeights w = split_weights(lse_a, lse_b);
    if (p.lse != nullptr && lane == 0 && warp % 4 == 0) p.lse[row_offset(p, t, kv_head, r) / kHeadDim] = w.lse;
    float acc0 = 0.f, acc1 = 0.f;
    for (int s0 = 0;;) {
#pragma unroll
      for (int j = 0; j < kMergeKernelUnroll; ++j) {
        const int s = s0 + j;
        const float ws = __shfl_sync(kFullMask, s < 32 ? w.a : w.b, s & 31);
        const float wj = s < tile_splits ? ws : 0.f;
        acc0 += wj * v[j].x, acc1 += wj * v[j].y;
      }
      s0 += kMergeKernelUnroll;
      if (s0 >= tile_splits) break;
      load_splits(s0);
    }
    __nv_bfloat16* const dst = p.out + row_offset(p, t, kv_head, r) + col;
    *reinterpret_cast<uint32_t*>(dst) = pack_bf16x2(acc0, acc1);
  }
}

constexpr int kMaxDevices = 64;

// What a launch on a device needs to know of it, found once per device (the dynamic shared-memory opt-in is set on
// the way): the CTAs it holds at once (SMs x CTAs per SM at this kernel's shared memory) and whether it takes a
// programmatic dependent launch (sm_90 and later), which the merge grid uses.
struct DeviceLaunch {
  int ctas;
  bool dependent_launch;
};

static int device_launch(int device, DeviceLaunch* out) {
  static std::atomic<int> cache[kMaxDevices];  // 2 ctas + dependent_launch; 0: not found yet
  if (device >= 0 && device < kMaxDevices) {
    const int c = cache[device].load(std::memory_order_acquire);
    if (c != 0) {
      *out = {c >> 1, (c & 1) != 0};
      return 0;
    }
  }
  int optin = 0, sms = 0, per_sm = 0, major = 0;
  cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (optin < kSmemBytes) return PW_PREFILL_ERR_SMEM_UNAVAILABLE;
  e = cudaFuncSetAttribute(pw_decode_hd256_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(pw_decode_hd256_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, pw_decode_hd256_kernel, kThreads, kSmemBytes);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (per_sm < 1) return PW_PREFILL_ERR_SMEM_UNAVAILABLE;
  *out = {sms * per_sm, major >= 9};
  if (device >= 0 && device < kMaxDevices)
    cache[device].store(2 * out->ctas + (out->dependent_launch ? 1 : 0), std::memory_order_release);
  return 0;
}

}  // namespace pw_decode

// The timeline of a -DPW_DECODE_TRACE=1 build (decode_trace.cuh): copies min(words, the buffer's) uint64 into host
// memory `dst`, then zeroes the buffer. Returns the words copied, -1 in a build without the trace, or -(CUDA
// error). Synchronises with the device.
extern "C" long long pw_decode_trace(unsigned long long* dst, long long words) {
#if PW_DECODE_TRACE
  return pw_copy_trace_and_zero(pw_decode::g_decode_trace, dst, words);
#else
  (void)dst;
  (void)words;
  return -1;
#endif
}

// The trace's layout (decode_trace.cuh): {CTAs traced, uint64 per CTA}.
extern "C" void pw_decode_trace_layout(int* out) {
  out[0] = pw_decode::kDecodeTraceCtas;
  out[1] = pw_decode::kDecodeTraceSlots;
}

// Launch the decode kernel for a checked parameter block (pw_prefill_prepare) on the current device:
// a persistent grid of at most the CTAs the device holds, never more than the plan's units can use.
int pw_decode_hd256_launch(const PwPrefillParams& p, int grid_tiles, int max_tile_splits, cudaStream_t stream) {
  using namespace pw_decode;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return static_cast<int>(e);
  DeviceLaunch shape;
  const int rc = device_launch(device, &shape);
  if (rc != 0) return rc;
  const long long most_units =
      static_cast<long long>(grid_tiles) * p.num_kv_heads * (p.workspace_units > 0 ? kMaxSplits : 1);
  const unsigned grid = static_cast<unsigned>(most_units < shape.ctas ? most_units : shape.ctas);
  // The merge grid runs when the plan's tile capacity splits tiles more than kGridMergeMaxSplits ways (a plan
  // filled below its capacity splits more, never fewer); the decode kernel leaves it those tiles only then.
  const long long capacity_items = static_cast<long long>(grid_tiles) * p.num_kv_heads;
  long long capacity_splits = capacity_items > 0 ? p.workspace_units / capacity_items : 0;
  if (capacity_splits > kMaxSplits) capacity_splits = kMaxSplits;
  bool merge_after = capacity_splits > kGridMergeMaxSplits;
  // An eager launch whose plan update bounds every live tile at kGridMergeMaxSplits splits or fewer has nothing
  // for the merge grid (a one-key decode step, above all): it runs none. Under stream capture the capacity's rule
  // holds, since the graph replays after later updates.
  if (merge_after && max_tile_splits > 0 && max_tile_splits <= kGridMergeMaxSplits) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    e = cudaStreamIsCapturing(stream, &capture);
    if (e != cudaSuccess) return static_cast<int>(e);
    merge_after = capture != cudaStreamCaptureStatusNone;
  }
  pw_decode_hd256_kernel<<<grid, kThreads, kSmemBytes, stream>>>(p, merge_after);
  if (!merge_after) return static_cast<int>(cudaGetLastError());
  e = cudaGetLastError();
  if (e != cudaSuccess) return static_cast<int>(e);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(capacity_items));
  cfg.blockDim = dim3(kMergeThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // sm_90: start before the decode grid ends
  attr[0].val.programmaticStreamSerializationAllowed = shape.dependent_launch ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  e = cudaLaunchKernelEx(&cfg, pw_decode_merge_kernel, p);
  if (e != cudaSuccess) return static_cast<int>(e);
  return static_cast<int>(cudaGetLastError());
}
