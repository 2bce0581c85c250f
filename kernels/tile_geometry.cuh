// pagedwindow: a tile's geometry read from the plan, shared by the two prefill kernels (prefill_hd256.cu,
// prefill_hd256_sm90.cu). decode_hd256.cu computes the same quantities for its 16-row tiles and 16-key steps in
// its own tile_geometry.
//
// A tile is a run of kRows packed query rows of one request (packed row r = token r / group, q head
// kv_head * group + r % group). Query token j of request r sits at KV position q_pos = kv_len_r - seq_r + j
// (bottom-right causal); key k is visible from it iff k <= q_pos and (window_left < 0 or q_pos - k <= window_left).
// The tile's keys are those any of its rows can see, [kv_lo, kv_hi), walked in KV tiles of kKvTile keys from
// kv_start (kv_lo rounded down to kKvTile): KV tiles wholly left of the window are never read.
#pragma once

#include "prefill_launch.cuh"  // PwPrefillParams

namespace pw_tile {

// Uniform across the CTA (or warp) that runs the tile.
struct TileGeometry {
  int qo_begin;     // the request's first token (its row in q and out)
  int seq;          // the request's tokens
  int page_base;    // the request's first entry in page_indices
  int kv_len;       // the request's keys
  int group;        // packed rows per token: query heads per KV head (the parameter block's)
  int window_left;  // the parameter block's: < 0 no window
  int row0;         // first packed row of the tile
  int rows_valid;   // packed rows the tile owns (<= 0: a tile past its request's rows, nothing to do)
  int q_shift;      // q_pos = q_shift + token
  int qpos_first;   // KV position of the tile's first row
  int qpos_last;    // and of its last row
  int kv_lo;        // first key any row of the tile can see
  int kv_hi;        // one past the last one
  int kv_start;     // first key of the first KV tile (kv_lo rounded down to kKvTile)
  int n_tiles;      // KV tiles of kKvTile keys from kv_start that cover [kv_lo, kv_hi)
};

// The request and rows of plan tile `tile` (tiles of kRows packed rows): qo_begin .. rows_valid.
template <int kRows>
__device__ __forceinline__ TileGeometry tile_rows(const PwPrefillParams& p, int tile) {
  TileGeometry t;
  const int req = p.request_indices[tile];
  const int qtile = p.qo_tile_indices[tile];
  t.qo_begin = p.qo_indptr[req];
  t.seq = p.qo_indptr[req + 1] - t.qo_begin;
  t.page_base = p.page_indptr[req];
  const int num_pages = p.page_indptr[req + 1] - t.page_base;
  t.kv_len = (num_pages - 1) * p.page_size + p.last_page_len[req];
  t.group = p.group;
  t.row0 = qtile * kRows;
  t.rows_valid = min(kRows, t.seq * t.group - t.row0);
  return t;
}

// The rest: the rows' KV positions, the keys they can see, and the KV tiles of kKvTile keys that cover them.
template <int kKvTile>
__device__ __forceinline__ void tile_keys(const PwPrefillParams& p, TileGeometry& t) {
  t.q_shift = t.kv_len - t.seq;
  t.qpos_first = t.q_shift + t.row0 / t.group;
  t.qpos_last = t.q_shift + (t.row0 + max(t.rows_valid, 1) - 1) / t.group;
  t.window_left = p.window_left;
  t.kv_lo = (t.window_left >= 0) ? max(t.qpos_first - t.window_left, 0) : 0;
  t.kv_hi = min(t.qpos_last + 1, t.kv_len);
  t.kv_start = (t.kv_lo / kKvTile) * kKvTile;
  t.n_tiles = (t.kv_hi > t.kv_start) ? (t.kv_hi - t.kv_start + kKvTile - 1) / kKvTile : 0;
}

// The whole geometry of plan tile `tile`. (The mma.sync kernel calls the two halves around its return on
// rows_valid <= 0, so that an empty tile computes nothing more.)
template <int kRows, int kKvTile>
__device__ __forceinline__ TileGeometry tile_geometry(const PwPrefillParams& p, int tile) {
  TileGeometry t = tile_rows<kRows>(p, tile);
  tile_keys<kKvTile>(p, t);
  return t;
}

// KV position of the request's packed row `packed_row` (the tile's rows are t.row0 .. t.row0 + rows_valid - 1).
__device__ __forceinline__ int qpos_of(const TileGeometry& t, int group, int packed_row) {
  return t.q_shift + packed_row / group;
}

}  // namespace pw_tile
