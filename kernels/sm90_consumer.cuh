// pagedwindow: the Hopper prefill kernel's (prefill_hd256_sm90.cu) consumer warpgroups: the mainloop.
//
// Consumer warpgroup cw owns packed rows [64 cw, 64 cw + 64) of the tile. Per KV tile: S = Q K^T with 16 x wgmma
// m64n64k16 (A = Q, B = K, both from shared memory, K-major, 128-byte swizzle); the boundary mask and online
// softmax in registers (fp32, exp2); P re-packed to bf16 A fragments in registers; O += P V with 4 x wgmma
// m64n256k16 (A = P from registers, B = V from shared memory, MN-major: transpose-B). O is 64 x 256 fp32 per
// warpgroup = 128 registers per thread.
//
// Overlap (FlashAttention-3's intra-warpgroup schedule): the consumer issues S(j+1) and O += P(j) V(j) back to
// back as two commit groups, waits for S(j+1) only, computes softmax(j+1) while PV(j) runs, then waits for PV(j)
// and rescales O. Two consumer warpgroups also ping-pong through the kBarSched named barriers (FlashAttention-3's
// warp-scheduler barrier), so that one warpgroup's softmax overlaps the other's GEMMs.
#pragma once

#include <math.h>
#include <stdint.h>

#include "online_softmax.cuh"   // mask_tile, OnlineSoftmax
#include "ptx_common.cuh"       // pack_bf16x2
#include "sm90_config.cuh"      // Cfg, Smem, stage_of / parity_of, shapes, named barriers
#include "sm90_ptx.cuh"         // mbarriers, named barriers, wgmma
#include "sm90_wait_trace.cuh"  // WaitTrace (records only in a -DPW_SM90_WAIT_TRACE=1 build)
#include "tile_geometry.cuh"    // TileGeometry, qpos_of

#ifdef PW_SM90_DEVICE_CODE
namespace pw_prefill_sm90 {

using pw_tile::qpos_of;
using pw_tile::TileGeometry;

// A consumer thread's place in the CTA, and the two parameters its rows' positions need (read once).
struct ConsumerThread {
  int kv_head;      // blockIdx.y
  int cw;           // consumer warpgroup 0 .. kWG-1 (warpgroup 1 + cw of the CTA)
  int warp, lane;   // warp of the warpgroup, lane
  int g;            // accumulator row within the warp's 16 rows (and g + 8)
  int c4;           // accumulator column pair
  int group;        // the parameter block's
  int window_left;  // the parameter block's
  int lrow0;        // this thread's rows of the tile: lrow0 (index 0) and lrow0 + 8 (index 1)
  __device__ __forceinline__ explicit ConsumerThread(const Params& p)
      : kv_head(blockIdx.y),
        cw((threadIdx.x >> 7) - 1),
        warp((threadIdx.x >> 5) & 3),
        lane(threadIdx.x & 31),
        g(lane >> 2),
        c4(lane & 3),
        group(p.group),
        window_left(p.window_left),
        lrow0(kWarpgroupRows * cw + kAccRowsPerWarp * warp + g) {}
};

// The ping-pong of two consumer warpgroups (FlashAttention-3's warp-scheduler barrier): a turn is the right to
// issue GEMMs, so that one warpgroup's softmax overlaps the other's GEMMs. Consumer cw waits for its turn on named
// barrier kBarSched + cw and passes the turn on by arriving on the other's. Each takes n_tiles + 1 turns;
// consumer 1 arrives once up front (consumer 0 goes first) and does not pass on its last turn, so every barrier
// generation gets exactly kBarSchedThreads arrivals: 128 waiting threads + 128 arriving ones. With one consumer
// warpgroup there is no one to take turns with: no-ops.
template <int kWG>
struct PingPong {
  static constexpr bool kOn = kWG == 2 && PW_SM90_PINGPONG;
  int cw;
  __device__ __forceinline__ void start() const {
    if constexpr (kOn) {
      if (cw == 1) named_bar_arrive(kBarSched + 0, kBarSchedThreads);
    }
  }
  __device__ __forceinline__ void wait_turn() const {
    if constexpr (kOn) named_bar_sync(kBarSched + cw, kBarSchedThreads);
  }
  __device__ __forceinline__ void pass_turn() const {
    if constexpr (kOn) named_bar_arrive(kBarSched + (1 - cw), kBarSchedThreads);
  }
  __device__ __forceinline__ void pass_last_turn() const {
    if constexpr (kOn) {
      if (cw == 0) named_bar_arrive(kBarSched + 1, kBarSchedThreads);
    }
  }
};

constexpr int kSKSteps = kHeadDim / 16;  // k-steps of S = Q K^T: 16 head dims each
constexpr int kPvKSteps = kKvTile / 16;  // k-steps of O += P V: 16 keys each

// The mainloop of consumer warpgroup th.cw (0 .. kWG-1), which owns packed rows [64 cw, 64 cw + 64) of the tile:
// leaves this thread's fragment of O (unnormalised) in o and its rows' running max and sums in softmax.
template <int kCtaQ, int kWG>
__device__ __forceinline__ void consumer_mainloop(const Params& p, const Smem<kCtaQ, kWG>& sm, const TileGeometry& t,
                                                  const ConsumerThread& th, float (&o)[kORegs],
                                                  pw_softmax::OnlineSoftmax& softmax) {
  using C = Cfg<kCtaQ, kWG>;
  const int cw = th.cw, lane = th.lane, c4 = th.c4, lrow0 = th.lrow0;
  const int group = th.group;
  const int wl = th.window_left;
  const int qp0 = qpos_of(t, group, t.row0 + lrow0);
  const int qp1 = qpos_of(t, group, t.row0 + lrow0 + 8);
  const int lo0 = (wl >= 0) ? qp0 - wl : 0;
  const int lo1 = (wl >= 0) ? qp1 - wl : 0;
  const float sl2 = p.scale_log2;
  // Query positions spanned by this warpgroup's rows (for the "no mask needed" test).
  const int wq_first = qpos_of(t, group, t.row0 + kWarpgroupRows * cw);
  const int wq_last = qpos_of(
      t, group, t.row0 + max(kWarpgroupRows * cw, min(kWarpgroupRows * cw + kWarpgroupRows - 1, t.rows_valid - 1)));

  // Descriptor low words. Q: this warpgroup's 64 rows start 64 * 128 B into each 64-column block of Q. Q and K
  // are K-major (LBO unused with the swizzle: 16), V is MN-major (LBO: the next 64 head dims, one block).
  const uint32_t dq = desc_lo(sm.q + cw * kWarpgroupRows * kBlockRowBytes, kDescLboUnused);
  const uint32_t dk0 = desc_lo(sm.k, kDescLboUnused);
  const uint32_t dv0 = desc_lo(sm.v, kKvBlockBytes);

#pragma unroll
  for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
  float s[kSRegs];  // written by the first S wgmma of every tile (scale-d = 0)

  // Issue (no fence, no commit) S = Q K^T for the tile in buffer st: 16 k-steps of 16 head dims, 64-column
  // block kk/4 and +32 B per k-step inside it. s[4n + e] = row (e < 2 ? g : g + 8) of the warp,
  // key kb + 8n + 2 c4 + (e & 1).
  auto gemm_s = [&](int st) {
    const uint32_t dk = dk0 + st * (kKvBytes >> 4);
    wgmma_m64n64k16_ss_first(s, make_desc(dq), make_desc(dk));
#pragma unroll
    for (int kk = 1; kk < (PW_SM90_PROBE_HALF_S ? kSKSteps / 2 : kSKSteps); ++kk) {
      const uint32_t qo = (kk >> 2) * (C::kQBlockBytes >> 4) + (kk & 3) * 2;
      const uint32_t ko = (kk >> 2) * (kKvBlockBytes >> 4) + (kk & 3) * 2;
      wgmma_m64n64k16_ss_acc(s, make_desc(dq + qo), make_desc(dk + ko));
    }
  };
  // Issue (no fence, no commit) O += P V for the tile in buffer st: 4 k-steps of 16 keys = rows 16ks.. of V,
  // +2048 B each (two 8-key groups, SBO = 1024 B). o[4i + e] = row (e < 2 ? g : g + 8) of the warp,
  // head dim 8i + 2 c4 + (e & 1).
  uint32_t pf[kPvKSteps][4];  // P of the tile whose PV GEMM is issued next (bf16 wgmma A fragments)
  auto gemm_pv = [&](int st) {
    const uint32_t dv = dv0 + st * (kKvBytes >> 4);
#pragma unroll
    for (int ks = 0; ks < kPvKSteps; ++ks) {
      wgmma_m64n256k16_rs_tb(o, pf[ks][0], pf[ks][1], pf[ks][2], pf[ks][3], make_desc(dv + ks * (kVKStepBytes >> 4)));
    }
  };

  // Mask (boundary tiles only) and online softmax of tile j held in s (log2 domain): updates m and l, leaves
  // P(j) in s (fp32), and returns the factors alpha by which O must be rescaled before P(j) V(j) is added.
  // Neither O nor pf is touched here: a PV GEMM may still be reading pf and accumulating into O (ptxas
  // serialises every wgmma if a wgmma input register is written while any wgmma is in flight).
  auto softmax_p = [&](int j, float& alpha0, float& alpha1) {
    if constexpr (PW_SM90_PROBE_NO_SOFTMAX) {  // a measurement build: P = S, O never rescaled (not attention)
      alpha0 = alpha1 = 1.f;
      return;
    }
    auto at = [&](int n, int e) -> float& { return s[4 * n + e]; };
    const int kb = t.kv_start + j * kKvTile;
    const bool full_tile = (kb + kKvTile - 1 <= wq_first) && (wl < 0 || kb >= wq_last - wl);
    if (!full_tile) pw_softmax::mask_tile(at, kb, c4, lo0, qp0, lo1, qp1);
    softmax.step(at, sl2, alpha0, alpha1);
    if constexpr (PW_SM90_PROBE_NO_RESCALE) alpha0 = alpha1 = 1.f;  // a measurement build (not attention)
  };
  // P (fp32, in s) -> bf16 wgmma A fragments in pf (same per-warp layout as mma.m16n8k16's A): k-step ks =
  // keys 16ks .. 16ks+15 = S n-tiles 2ks (keys +0..7) and 2ks+1 (keys +8..15). Only with no wgmma in flight.
  auto pack_p = [&]() {
#pragma unroll
    for (int ks = 0; ks < kPvKSteps; ++ks) {
      pf[ks][0] = pack_bf16x2(s[8 * ks + 0], s[8 * ks + 1]);  // row g,   keys 2c, 2c+1
      pf[ks][1] = pack_bf16x2(s[8 * ks + 2], s[8 * ks + 3]);  // row g+8, keys 2c, 2c+1
      pf[ks][2] = pack_bf16x2(s[8 * ks + 4], s[8 * ks + 5]);  // row g,   keys 8+2c, 8+2c+1
      pf[ks][3] = pack_bf16x2(s[8 * ks + 6], s[8 * ks + 7]);  // row g+8, keys 8+2c, 8+2c+1
    }
  };
  auto rescale_o = [&](float alpha0, float alpha1) {
#pragma unroll
    for (int n = 0; n < kORegs / 4; ++n) {
      o[4 * n + 0] *= alpha0;
      o[4 * n + 1] *= alpha0;
      o[4 * n + 2] *= alpha1;
      o[4 * n + 3] *= alpha1;
    }
  };
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  // Pin O, S or P in registers at this point of the program (see reg_fence).
  auto pin_o = [&]() {
#pragma unroll
    for (int i = 0; i < kORegs; ++i) reg_fence(o[i]);
  };
  auto pin_s = [&]() {
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) reg_fence(s[i]);
  };
  auto pin_p = [&]() {
#pragma unroll
    for (int ks = 0; ks < kPvKSteps; ++ks) {
      reg_fence_u32(pf[ks][0]);
      reg_fence_u32(pf[ks][1]);
      reg_fence_u32(pf[ks][2]);
      reg_fence_u32(pf[ks][3]);
    }
  };
  const PingPong<kWG> pp{cw};

  // Schedule (per consumer warpgroup; a turn is issuing GEMMs, see PingPong):
  //   turn 0: S(0);  wait;  softmax(0) -> P(0)
  //   for j < n-1:  turn j+1: S(j+1), PV(j);  wait S(j+1);  release K(j+1);  softmax(j+1) -> P(j+1) while
  //                 PV(j) runs;  wait PV(j);  release V(j);  rescale O
  //   turn n: PV(n-1);  wait
  // With PW_SM90_PINGPONG=0 a turn is not waited for.
  // No wgmma is in flight across a loop edge or a conditional path (ptxas would otherwise serialise every
  // wgmma); the last tile is peeled.
  pin_o();  // materialise O = 0 before any wgmma is in flight
  WaitTrace trace(cw);
  trace.wait(kTraceSlotQ, sm.q_full(), 0);
  const int n_tiles = t.n_tiles;
  if (n_tiles > 0) {  // always true when rows_valid > 0; uniform across the CTA
    float alpha0, alpha1;
    // ---- turn 0: S(0)
    trace.wait(kTraceSlotK0, sm.full_k(0), 0);
    fence_proxy_async();
    pp.start();
    pp.wait_turn();
    wgmma_fence();
    gemm_s(0);
    wgmma_commit();
    pp.pass_turn();
    wgmma_wait<0>();
    pin_s();
    release(sm.empty_k(0));
    softmax_p(0, alpha0, alpha1);  // O is 0: no rescale needed
    pack_p();

#pragma unroll 1
    for (int j = 0; j < n_tiles - 1; ++j) {
      const int j1 = j + 1;
      trace.iteration(j);
      trace.wait_k(j, sm.full_k(stage_of(j1)), parity_of(j1));
      trace.wait_v(j, sm.full_v(stage_of(j)), parity_of(j));
      fence_proxy_async();
      // ---- turn j+1: S(j+1), then PV(j) (two commit groups, in this order)
      pp.wait_turn();
      wgmma_fence();
      pin_o();
      gemm_s(stage_of(j1));
      wgmma_commit();
      gemm_pv(stage_of(j));
      wgmma_commit();
      pp.pass_turn();
      wgmma_wait<1>();  // S(j+1) has completed (K(j+1) is read); PV(j) may still run
      pin_s();
      // K(j+1)'s buffer goes back now, a softmax before it would otherwise: the producer's next copy into it
      // gains that much lead (a copy takes about one iteration; NOTES.md, the waits per iteration).
      release(sm.empty_k(stage_of(j1)));
      softmax_p(j1, alpha0, alpha1);  // overlaps PV(j) on the tensor cores
      // Keep the softmax above the wait for PV(j): an arrive on the overlap anchor that depends on it (the
      // condition is always true: l0, l1 >= 0, or NaN). Without it ptxas sinks the softmax below that wait.
      __syncwarp();
      if (lane == 0 && !(softmax.l0 + softmax.l1 < 0.f)) mbar_arrive(sm.overlap_anchor());
      wgmma_wait<0>();  // PV(j) has completed
      pin_o();
      pin_p();
      release(sm.empty_v(stage_of(j)));
      rescale_o(alpha0, alpha1);
      pack_p();
    }

    trace.finish(n_tiles - 1, n_tiles);
    // ---- turn n: PV(n-1)
    trace.wait(kTraceSlotLastV, sm.full_v(stage_of(n_tiles - 1)), parity_of(n_tiles - 1));
    fence_proxy_async();
    pp.wait_turn();
    wgmma_fence();
    pin_o();
    gemm_pv(stage_of(n_tiles - 1));
    wgmma_commit();
    pp.pass_last_turn();
    wgmma_wait<0>();
    trace_consumer_clock(cw, kTraceSlotPvDone);
  }
  pin_o();
}

}  // namespace pw_prefill_sm90
#endif  // PW_SM90_DEVICE_CODE
