// pagedwindow: the Hopper prefill kernel's (prefill_hd256_sm90.cu) load pipeline: the producer warpgroup
// (warpgroup 0) and the mbarriers it shares with the consumer warpgroups.
//
// Barriers (shared memory, Smem): q_full, then per stage s (KV tile j uses stage j % kStages) full_k[s],
// full_v[s], empty_k[s], empty_v[s].
//   * q_full completes once Q has landed: one cp.async-tracked arrival per producer thread, and the bytes of Q's
//     bulk tensor copies when there are any (posted by thread 0 before its arrival).
//   * full_x[s] completes once tile j's K (V) has landed in stage s: with cp.async copies one tracked arrival per
//     producer thread; with bulk tensor copies one arrival carrying the tile's byte count, completed by the
//     copies themselves.
//   * empty_x[s] completes once every consumer warp has finished reading stage s: one arrival per consumer warp.
// Tile j is the (j / kStages)-th use of its stage: consumers wait full with parity (j / kStages) & 1, the
// producer waits empty with the opposite parity, so the first use of each stage passes at once.
//
// Two ways to copy a K/V tile, chosen by the host per call (the kernel's kTma):
//   * producer_tma: bulk tensor copies (page_size 8, 16, 32 or a multiple of 64) through two tensor maps over
//     the pool, {head dim, kv head, slot, page}, written with the 128-byte swizzle;
//   * producer_cp_async: 16-byte cp.async of every key row with its own page lookup (any page_size).
// Both load Q first (load_q: bulk tensor copies of whole warpgroups' rows where it can, cp.async for the rest) and
// read only keys below kv_len. The cp.async path zero-fills keys outside
// [kv_lo, kv_hi) instead of reading them; the bulk path reads them, and the consumers mask them.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include <cuda.h>  // CUtensorMap

#include "ptx_common.cuh"       // cp_async_16, st_shared_v4
#include "sm90_config.cuh"      // Cfg, Smem, sw128, stage_of / parity_of, shapes
#include "sm90_ptx.cuh"         // mbarriers, bulk tensor copies
#include "sm90_wait_trace.cuh"  // ProducerTrace
#include "tile_geometry.cuh"    // TileGeometry

#ifdef PW_SM90_DEVICE_CODE
namespace pw_prefill_sm90 {

using pw_tile::TileGeometry;

// Thread 0, before anything else: the arrival counts above.
template <int kCtaQ, int kWG, bool kTma>
__device__ __forceinline__ void init_pipeline_barriers(const Smem<kCtaQ, kWG>& sm) {
  mbar_init(sm.q_full(), kProducerThreads);
  constexpr uint32_t kFullCount = kTma ? 1 : kProducerThreads;
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    mbar_init(sm.full_k(s), kFullCount);
    mbar_init(sm.full_v(s), kFullCount);
    mbar_init(sm.empty_k(s), kWarpgroupWarps * kWG);
    mbar_init(sm.empty_v(s), kWarpgroupWarps * kWG);
  }
  mbar_init(sm.overlap_anchor(), 1);
  mbar_init_fence();
}

// Producer, cp.async copy: a warp's 16 rows of a 64-key tile (rows 16*pw .. 16*pw + 15; lane = 16-byte chunk).
// `off` holds, in lane i < 16, the pool element offset of row 16*pw + i (or -1: outside [kv_lo, kv_hi),
// zero-filled).
__device__ __forceinline__ void issue_kv_rows(uint32_t s_tile, const __nv_bfloat16* pool_lane,
                                              const __nv_bfloat16* pool, long long off, int pw, int lane) {
#pragma unroll
  for (int i = 0; i < kKvRowsPerWarp; ++i) {
    const long long row_off = __shfl_sync(0xffffffffu, off, i);
    const bool valid = row_off >= 0;
    const void* src = valid ? static_cast<const void*>(pool_lane + row_off) : static_cast<const void*>(pool);
    cp_async_16(s_tile + sw128<kKvTile>(pw * kKvRowsPerWarp + i, lane), src, valid ? 16 : 0);
  }
}

// Producer, Q tile (all four warps). Rows [0, bulk_rows) (q_bulk_rows: whole consumer warpgroups' 64 rows, all the
// tile's) come by thread 0's bulk tensor copies through map_q, four per warpgroup (box {64 dims, group heads,
// 64 / group tokens} per 64-column block, written with the 128-byte swizzle), their bytes posted on q_full first.
// The other rows by cp.async (rows past rows_valid zero-filled): warp w copies rows bulk_rows + w, + 4, ...; row r
// -> (token, head in group) walked by 4; lane = 16-byte chunk. Each thread arrives on q_full once its copies have
// landed.
template <int kCtaQ, int kWG>
__device__ __forceinline__ void load_q(const Params& p, const Smem<kCtaQ, kWG>& sm, const TileGeometry& t, int kv_head,
                                       const CUtensorMap* map_q, int bulk_rows, int warp, int lane) {
  using C = Cfg<kCtaQ, kWG>;
  const int grp = p.group;
  if (bulk_rows > 0 && warp == 0 && lane == 0) {
    mbar_expect_tx(sm.q_full(), static_cast<uint32_t>(bulk_rows) * kRowBytes);
    for (int r0 = 0; r0 < bulk_rows; r0 += kWarpgroupRows) {
      const int token0 = t.qo_begin + (t.row0 + r0) / grp;  // group divides 64 (the host's map needs it)
#pragma unroll
      for (int b = 0; b < kHeadDim / kBlockCols; ++b) {
        tma_load_3d(sm.q + b * C::kQBlockBytes + r0 * kBlockRowBytes, map_q, b * kBlockCols, kv_head * grp, token0,
                    sm.q_full());
      }
    }
  }
  const int pr0 = t.row0 + bulk_rows + warp;
  int tok = pr0 / grp;
  int hg = pr0 - tok * grp;
  const int step_tok = kWarpgroupWarps / grp;
  const int step_hg = kWarpgroupWarps - step_tok * grp;
#pragma unroll 4
  for (int it = bulk_rows / kWarpgroupWarps; it < C::kRowsQ / kWarpgroupWarps; ++it) {
    const int r = warp + kWarpgroupWarps * it;
    const bool valid = r < t.rows_valid;
    const void* src = p.q;
    if (valid) {
      const int head = kv_head * grp + hg;
      src = p.q + (static_cast<long long>(t.qo_begin + tok) * p.num_qo_heads + head) * kHeadDim + lane * kChunkElems;
    }
    cp_async_16(sm.q + sw128<C::kRowsQ>(r, lane), src, valid ? 16 : 0);
    tok += step_tok;
    hg += step_hg;
    if (hg >= grp) {
      hg -= grp;
      ++tok;
    }
  }
  cp_async_mbar_arrive(sm.q_full());
}

// cp.async producer (any page_size). Loads Q, then K(j) and V(j) of every KV tile into buffer j % 2. Warp w
// copies key rows 16w .. 16w+15 of every tile, K then V; lane = 16-byte chunk (one 512-byte row per instruction).
// All four warps copy every tile: a warp's copies go through its own scheduler's load/store path.
template <int kCtaQ, int kWG>
__device__ __forceinline__ void producer_cp_async(const Params& p, const Smem<kCtaQ, kWG>& sm, const CUtensorMap* map_q,
                                                  bool q_bulk) {
  const TileGeometry t = pw_tile::tile_geometry<kCtaQ, kKvTile>(p, blockIdx.x);
  const int kv_head = blockIdx.y;
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;

  // Key row 16*warp + (lane & 15) of every tile (lanes 0..15 own a row; lanes 16..31 carry a copy that is never
  // used): pos = pi * page_size + slot with 0 <= slot < page_size, advanced by kKvTile per tile without a
  // division (slot + step_slot <= 2 page_size - 2, so one conditional subtraction restores the invariant).
  const int ps = p.page_size;
  const int* const pages = p.page_indices + t.page_base;
  int pos = t.kv_start + warp * kKvRowsPerWarp + (lane & 15);
  int pi = pos / ps;
  int slot = pos - pi * ps;
  const int step_pi = kKvTile / ps;
  const int step_slot = kKvTile - step_pi * ps;
  // A row outside [kv_lo, kv_hi) is zero-filled and its page never read.
  auto row_valid = [&](int x) { return lane < kKvRowsPerWarp && x >= t.kv_lo && x < t.kv_hi; };
  int page = 0;  // page id of the current tile's row (valid rows only), loaded one tile ahead
  if (row_valid(pos)) page = __ldg(pages + pi);  // tile 0: in flight while Q is issued

  load_q(p, sm, t, kv_head, map_q, q_bulk_rows<kCtaQ, kWG>(t.rows_valid, q_bulk), warp, lane);

#pragma unroll 1
  for (int j = 0; j < t.n_tiles; ++j) {
    // Pool offset of key row 16*warp + lane (lanes 0..15; -1: outside [kv_lo, kv_hi), zero-filled). `page` was
    // loaded one tile ago (or before Q for tile 0). Then step to tile j+1 and load its page id now: it is in
    // flight while this tile's barriers are waited on and its K/V copies issued.
    long long off = -1;
    if (row_valid(pos)) {
      off = static_cast<long long>(page) * p.page_stride +
            static_cast<long long>(slot * p.num_kv_heads + kv_head) * kHeadDim;
    }
    pos += kKvTile;
    pi += step_pi;
    slot += step_slot;
    if (slot >= ps) {
      slot -= ps;
      ++pi;
    }
    if (row_valid(pos)) page = __ldg(pages + pi);  // tile j+1 (never past kv_hi: no read beyond the last tile)
    const int st = stage_of(j);
    const uint32_t empty_parity = parity_of(j) ^ 1;  // the first use of a buffer passes at once
    mbar_wait<true>(sm.empty_k(st), empty_parity);
    issue_kv_rows(sm.k + st * kKvBytes, p.pool + p.k_offset + lane * kChunkElems, p.pool, off, warp, lane);
    cp_async_mbar_arrive(sm.full_k(st));
    mbar_wait<true>(sm.empty_v(st), empty_parity);
    issue_kv_rows(sm.v + st * kKvBytes, p.pool + p.v_offset + lane * kChunkElems, p.pool, off, warp, lane);
    cp_async_mbar_arrive(sm.full_v(st));
  }
  cp_async_wait_all();  // leave no copy in flight behind an exiting thread
}

// TMA producer (page_size 8, 16, 32 or a multiple of 64; the host checks). Warps 0-3 load Q (load_q);
// then warp 0 copies K(j) and warp 1 V(j) of every KV tile (their first tile's page ids loaded before Q). A 64-key tile
// is 64 / box_rows chunks of box_rows = min(page_size, 64) keys inside one page; lane 4c + b copies 64-column block b
// of chunk c with one bulk tensor copy: box {64 dims, 1 head, box_rows slots, 1 page} of the map, written with the
// 128-byte swizzle into exactly the layout the cp.async producer writes. A chunk reaching past the request's kv_len
// (only in the last tile of a request) is copied by the warp's cp.async instead, zeros past kv_len, so that no slot
// past the request's length (unspecified contents, possibly NaN) reaches the PV GEMM. Lane 0 arrives on the buffer's
// "full" barrier with the tile's bulk-copy byte count (count 1 per phase); the phase completes when they land.
template <int kCtaQ, int kWG>
__device__ __forceinline__ void producer_tma(const Params& p, const Smem<kCtaQ, kWG>& sm, const CUtensorMap* map_k,
                                             const CUtensorMap* map_v, const CUtensorMap* map_q, bool q_bulk) {
  const TileGeometry t = pw_tile::tile_geometry<kCtaQ, kKvTile>(p, blockIdx.x);
  const int kv_head = blockIdx.y;
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int ps = p.page_size;
  const int box_rows = min(ps, kKvTile);
  const uint32_t box_bytes = static_cast<uint32_t>(box_rows) * kBlockRowBytes;
  const int chunk = lane >> 2, block = lane & 3;
  const bool has_box = chunk * box_rows < kKvTile;
  const int* const pages = p.page_indices + t.page_base;
  // First key of this lane's chunk: pos = pi * page_size + slot (slot is 0 unless page_size > 64), stepped by
  // kKvTile per tile without a division.
  int pos = t.kv_start + chunk * box_rows;
  int pi = pos / ps;
  int slot = pos - pi * ps;
  const int step_pi = kKvTile / ps;
  const int step_slot = kKvTile - step_pi * ps;
  auto box_inside = [&](int x) { return has_box && x + box_rows <= t.kv_len; };
  int page = 0;  // page id of the current tile's chunk, loaded one tile ahead: tile 0's in flight while Q is issued
  if (warp < 2 && box_inside(pos)) page = __ldg(pages + pi);

  load_q(p, sm, t, kv_head, map_q, q_bulk_rows<kCtaQ, kWG>(t.rows_valid, q_bulk), warp, lane);
  if (warp >= 2) {
    cp_async_wait_all();
    return;
  }
  const bool is_k = warp == 0;
  const CUtensorMap* const map = is_k ? map_k : map_v;
  const __nv_bfloat16* const pool_lane = p.pool + (is_k ? p.k_offset : p.v_offset) + lane * kChunkElems;
  ProducerTrace trace(lane);  // records only in a -DPW_SM90_WAIT_TRACE=1 build

#pragma unroll 1
  for (int j = 0; j < t.n_tiles; ++j) {
    const int tile_key0 = t.kv_start + j * kKvTile;
    const bool copy_box = box_inside(pos);
    const int c2 = slot, c3 = page;
    pos += kKvTile;
    pi += step_pi;
    slot += step_slot;
    if (slot >= ps) {
      slot -= ps;
      ++pi;
    }
    if (box_inside(pos)) page = __ldg(pages + pi);  // tile j+1
    const int st = stage_of(j);
    const uint32_t par = parity_of(j);
    const uint32_t buf = (is_k ? sm.k : sm.v) + st * kKvBytes;
    const uint32_t full = is_k ? sm.full_k(st) : sm.full_v(st);
    mbar_wait<true>(is_k ? sm.empty_k(st) : sm.empty_v(st), par ^ 1);  // the first use passes at once
    trace.issued(is_k, j);
    // Rows from the first chunk that reaches past kv_len (uniform across the warp): copied here by cp.async, zeros
    // past kv_len, landed and made visible to the tensor cores before the arrive below. The chunk lies in one page
    // (box_rows divides the page, or is 64 inside a page of a multiple of 64 keys), so its keys below kv_len need
    // one page id, and every row's copy is in flight at once (a row-by-row load and store waits a round trip per
    // row: up to 63 at page_size 64).
    const int tail_row0 = min(kKvTile, ((t.kv_len - tile_key0) / box_rows) * box_rows);
    if (tail_row0 < kKvTile) {
      const int tail_key0 = tile_key0 + tail_row0;  // the chunk's first key; at or past kv_len: every row zero
      const int valid_rows = t.kv_len - tile_key0;  // rows [tail_row0, valid_rows) are below kv_len
      const __nv_bfloat16* src = p.pool;
      if (tail_key0 < t.kv_len) {
        const int tail_pi = tail_key0 / ps;
        src = pool_lane + static_cast<long long>(__ldg(pages + tail_pi)) * p.page_stride +
              static_cast<long long>((tail_key0 - tail_pi * ps) * p.num_kv_heads + kv_head) * kHeadDim;
      }
      const int slot_elems = p.num_kv_heads * kHeadDim;  // from one slot's row to the next
#pragma unroll 1
      for (int r = tail_row0; r < kKvTile; ++r) {
        const bool valid = r < valid_rows;
        cp_async_16(buf + sw128<kKvTile>(r, lane), valid ? static_cast<const void*>(src) : p.pool, valid ? 16 : 0);
        src += slot_elems;
      }
      cp_async_wait_all();
      fence_proxy_async();
    }
    const uint32_t boxes = __popc(__ballot_sync(0xffffffffu, copy_box));
    __syncwarp();
    if (lane == 0) mbar_arrive_expect_tx(full, boxes * box_bytes);
    __syncwarp();  // the expected byte count is posted before any of the tile's copies can complete
    if (copy_box) {
      tma_load_4d(buf + block * kKvBlockBytes + chunk * box_bytes, map, block * kBlockCols, kv_head, c2, c3, full);
    }
  }
}

}  // namespace pw_prefill_sm90
#endif  // PW_SM90_DEVICE_CODE
