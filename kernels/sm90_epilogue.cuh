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

// The epilogue of consumer warpgroup cw after its mainloop: O / l as bf16, staged in the warpgroup's own Q rows
// (the same swizzled layout), then written to `out`; and the LSE. When all 64 of the warpgroup's rows are the
// tile's and the host gave a map of `out` (o_bulk), one thread writes them with four bulk tensor copies (one per
// 64-column block: box {64 dims, group heads, 64 / group tokens}, the 128-byte swizzle undone by the copy) and
// waits only until they have read shared memory; otherwise each warp copies its 16 rows out, 16 B per lane and
// one 512-byte row per instruction.
template <int kCtaQ, int kWG>
__device__ __forceinline__ void consumer_epilogue(const Params& p, const Smem<kCtaQ, kWG>& sm, const TileGeometry& t,
                                                  const ConsumerThread& th, const float (&o)[kORegs],
                                                  pw_softmax::OnlineSoftmax& softmax, const CUtensorMap* map_o,
                                                  bool o_bulk) {
  using C = Cfg<kCtaQ, kWG>;
  const int kv_head = th.kv_head, cw = th.cw, warp = th.warp, lane = th.lane, g = th.g, c4 = th.c4;
  const int group = th.group;
  const int lrow0 = th.lrow0;

  float inv0, inv1;
  softmax.finalize(inv0, inv1);

  // Only this warpgroup's S GEMMs ever read its 64 Q rows; all of them have completed once all four warps
  // have passed this barrier.
  named_bar_sync(kBarEpilogue + cw, kWarpgroupThreads);
#pragma unroll
  for (int n = 0; n < kORegs / 4; ++n) {
    // head dims 8n .. 8n+7 = 16-byte chunk n: block n / 8, chunk (n % 8) ^ (row % 8), row % 8 == g
    const uint32_t a = sm.q + (n >> 3) * C::kQBlockBytes + lrow0 * kBlockRowBytes + (((n & 7) ^ g) << 4) + c4 * 4;
    st_shared_b32(a, pack_bf16x2(o[4 * n + 0] * inv0, o[4 * n + 1] * inv0));
    st_shared_b32(a + 8 * kBlockRowBytes, pack_bf16x2(o[4 * n + 2] * inv1, o[4 * n + 3] * inv1));
  }
  __syncwarp();
  trace_consumer_clock(cw, kTraceSlotStaged);  // a -DPW_SM90_WAIT_TRACE=1 build only

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

  if (o_bulk && t.rows_valid >= kWarpgroupRows * (cw + 1)) {  // uniform across the warpgroup
    fence_proxy_async();                                      // the staged rows, visible to the bulk copies
    named_bar_sync(kBarEpilogue + cw, kWarpgroupThreads);     // all four warps have staged theirs
    if (warp == 0 && lane == 0) {
      const int token0 = t.qo_begin + (t.row0 + kWarpgroupRows * cw) / group;  // group divides 64 (the host checks)
#pragma unroll
      for (int b = 0; b < kHeadDim / kBlockCols; ++b) {
        tma_store_3d(map_o, sm.q + b * C::kQBlockBytes + cw * kWarpgroupRows * kBlockRowBytes, b * kBlockCols,
                     kv_head * group, token0);
      }
      bulk_commit_group();
      bulk_wait_group_read_all();  // the Q buffer stays the CTA's until this thread exits
    }
    return;
  }

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
