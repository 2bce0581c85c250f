// pagedwindow: the Hopper prefill kernel's (prefill_hd256_sm90.cu) epilogue, run by each consumer warpgroup
// after its mainloop: normalise O by 1/l, write the bf16 rows to `out` through shared memory, and the LSE.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include <cuda.h>  // CUtensorMap

#include "online_softmax.cuh"   // OnlineSoftmax
#include "ptx_common.cuh"       // pack_bf16x2, shared loads and stores
#include "sm90_config.cuh"      // Cfg, Smem, sw128, shapes, named barriers
#include "sm90_consumer.cuh"    // ConsumerThread
#include "sm90_ptx.cuh"         // named barriers
#include "sm90_wait_trace.cuh"  // trace_consumer_clock (records only in a -DPW_SM90_WAIT_TRACE=1 build)
#include "tile_geometry.cuh"    // TileGeometry

#ifdef PW_SM90_DEVICE_CODE
namespace pw_prefill_sm90 {

using pw_tile::TileGeometry;

// One 64-column block (block b: head dims 64b .. 64b + 63) of this warp's 16 rows of O / l, as bf16 into the
// warpgroup's own Q rows (the same swizzled layout): four stmatrix .x4, each two 8-column chunks of rows g and g + 8.
// Lane l gives the address of row (l / 8 % 2) * 8 + l % 8 of chunk 2k + l / 16 of the block.
template <int kCtaQ, int kWG>
__device__ __forceinline__ void stage_o_block_stmatrix(const Smem<kCtaQ, kWG>& sm, const ConsumerThread& th,
                                                       const float (&o)[kORegs], float inv0, float inv1, int b) {
  using C = Cfg<kCtaQ, kWG>;
  const int m = th.lane >> 3, i = th.lane & 7;
  const int row = kWarpgroupRows * th.cw + kAccRowsPerWarp * th.warp + (m & 1) * 8 + i;
  const uint32_t row_addr = sm.q + b * C::kQBlockBytes + row * kBlockRowBytes;
#pragma unroll
  for (int k = 0; k < kBlockCols / 16; ++k) {
    const int n = (kBlockCols / 8) * b + 2 * k;  // chunks n and n + 1 (head dims 8n .. 8n + 15)
    stmatrix_x4(row_addr + (((2 * k + (m >> 1)) ^ i) << 4), pack_bf16x2(o[4 * n + 0] * inv0, o[4 * n + 1] * inv0),
                pack_bf16x2(o[4 * n + 2] * inv1, o[4 * n + 3] * inv1),
                pack_bf16x2(o[4 * n + 4] * inv0, o[4 * n + 5] * inv0),
                pack_bf16x2(o[4 * n + 6] * inv1, o[4 * n + 7] * inv1));
  }
}

// All of this warp's 16 rows of O / l, as bf16 into the warpgroup's own Q rows.
template <int kCtaQ, int kWG>
__device__ __forceinline__ void stage_o(const Smem<kCtaQ, kWG>& sm, const ConsumerThread& th, const float (&o)[kORegs],
                                        float inv0, float inv1) {
  using C = Cfg<kCtaQ, kWG>;
  if constexpr (PW_SM90_O_STAGING >= 1) {
#pragma unroll
    for (int b = 0; b < kHeadDim / kBlockCols; ++b) stage_o_block_stmatrix<kCtaQ, kWG>(sm, th, o, inv0, inv1, b);
  } else {
#pragma unroll
    for (int n = 0; n < kORegs / 4; ++n) {
      // head dims 8n .. 8n+7 = 16-byte chunk n: block n / 8, chunk (n % 8) ^ (row % 8), row % 8 == g
      const uint32_t a =
          sm.q + (n >> 3) * C::kQBlockBytes + th.lrow0 * kBlockRowBytes + (((n & 7) ^ th.g) << 4) + th.c4 * 4;
      st_shared_b32(a, pack_bf16x2(o[4 * n + 0] * inv0, o[4 * n + 1] * inv0));
      st_shared_b32(a + 8 * kBlockRowBytes, pack_bf16x2(o[4 * n + 2] * inv1, o[4 * n + 3] * inv1));
    }
  }
}

// The epilogue of consumer warpgroup cw after its mainloop: O / l as bf16, staged in the warpgroup's own Q rows
// (the same swizzled layout), then written to `out`; and the LSE. When all 64 of the warpgroup's rows are the
// tile's and the host gave a map of `out` (o_bulk), one thread writes them with four bulk tensor copies (one per
// 64-column block: box {64 dims, group heads, 64 / group tokens}, the 128-byte swizzle undone by the copy), each
// issued once its block is staged (PW_SM90_O_STAGING 2), and waits only until they have read shared memory;
// otherwise each warp copies its 16 rows out, 16 B per lane and one 512-byte row per instruction.
template <int kCtaQ, int kWG>
__device__ __forceinline__ void consumer_epilogue(const Params& p, const Smem<kCtaQ, kWG>& sm, const TileGeometry& t,
                                                  const ConsumerThread& th, const float (&o)[kORegs],
                                                  pw_softmax::OnlineSoftmax& softmax, const CUtensorMap* map_o,
                                                  bool o_bulk) {
  using C = Cfg<kCtaQ, kWG>;
  const int kv_head = th.kv_head, cw = th.cw, warp = th.warp, lane = th.lane, c4 = th.c4;
  const int group = th.group;
  const int lrow0 = th.lrow0;
  const bool bulk = o_bulk && t.rows_valid >= kWarpgroupRows * (cw + 1);   // uniform across the warpgroup
  const int token0 = t.qo_begin + (t.row0 + kWarpgroupRows * cw) / group;  // group divides 64 (the host checks)

  float inv0, inv1;
  softmax.finalize(inv0, inv1);

  if (p.lse != nullptr && c4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = lrow0 + 8 * h;
      if (r < t.rows_valid) {
        const int pr = t.row0 + r;
        const int tok = pr / group;
        const int head = kv_head * group + (pr - tok * group);
        p.lse[static_cast<long long>(t.qo_begin + tok) * p.num_qo_heads + head] = softmax.lse(h);
      }
    }
  }

  // Only this warpgroup's S GEMMs ever read its 64 Q rows; all of them have completed once all four warps
  // have passed this barrier.
  named_bar_sync(kBarEpilogue + cw, kWarpgroupThreads);

  if (bulk) {
    // PW_SM90_O_STAGING 2: stage block b, then issue its copy; 0 and 1: stage every block, then issue the copies.
    constexpr bool kPerBlock = PW_SM90_O_STAGING == 2;
    if constexpr (!kPerBlock) {
      stage_o<kCtaQ, kWG>(sm, th, o, inv0, inv1);
      fence_proxy_async();                                   // the staged rows, visible to the bulk copies
      named_bar_sync(kBarEpilogue + cw, kWarpgroupThreads);  // all four warps have staged theirs
    }
#pragma unroll
    for (int b = 0; b < kHeadDim / kBlockCols; ++b) {
      if constexpr (kPerBlock) {
        stage_o_block_stmatrix<kCtaQ, kWG>(sm, th, o, inv0, inv1, b);
        fence_proxy_async();                                   // this block's staged rows, visible to its copy
        named_bar_sync(kBarEpilogue + cw, kWarpgroupThreads);  // all four warps have staged theirs
      }
      if (warp == 0 && lane == 0) {
        tma_store_3d(map_o, sm.q + b * C::kQBlockBytes + cw * kWarpgroupRows * kBlockRowBytes, b * kBlockCols,
                     kv_head * group, token0);
      }
    }
    trace_consumer_clock(cw, kTraceSlotStaged);  // a -DPW_SM90_WAIT_TRACE=1 build only
    if (warp == 0 && lane == 0) {
      bulk_commit_group();
      bulk_wait_group_read_all();  // the Q buffer stays the CTA's until this thread exits
    }
    return;
  }

  stage_o<kCtaQ, kWG>(sm, th, o, inv0, inv1);
  __syncwarp();
  trace_consumer_clock(cw, kTraceSlotStaged);  // a -DPW_SM90_WAIT_TRACE=1 build only

  // The warp reads back exactly the 16 rows it wrote.
#pragma unroll 4
  for (int i = 0; i < kAccRowsPerWarp; ++i) {
    const int r = kWarpgroupRows * cw + kAccRowsPerWarp * warp + i;
    if (r < t.rows_valid) {
      const int pr = t.row0 + r;
      const int tok = pr / group;
      const int head = kv_head * group + (pr - tok * group);
      const uint4 v = ld_shared_v4(sm.q + sw128<C::kRowsQ>(r, lane));
      __nv_bfloat16* dst =
          p.out + (static_cast<long long>(t.qo_begin + tok) * p.num_qo_heads + head) * kHeadDim + lane * kChunkElems;
      *reinterpret_cast<uint4*>(dst) = v;
    }
  }
}

}  // namespace pw_prefill_sm90
#endif  // PW_SM90_DEVICE_CODE
