// pagedwindow: windowed paged prefill attention, head_dim 256, bf16 in/out -- Hopper (sm_90a) wgmma path.
//
// Same semantics, arguments, plan arrays and error codes as pw_prefill_hd256_bf16 (prefill_hd256.cu), plus
// -12 (PW_PREFILL_ERR_NOT_SM90): this library was not built for sm_90a, or the current device is not 9.0.
//
//   query row j of request r sits at KV position q_pos = kv_len_r - seq_r + j (bottom-right causal);
//   key k (0 <= k < kv_len_r) is visible iff k <= q_pos and (window_left < 0 or q_pos - k <= window_left).
//   logits = sm_scale * q.k in fp32; softmax in fp32 (exp2 with log2(e) folded into the scale);
//   out = softmax . V accumulated in fp32, cast once to bf16. Optional natural-log LSE per (row, q head).
//
// Structure (FlashAttention-3-like, warp-specialised):
//   * CTA = 1 producer warpgroup + kWG consumer warpgroups (128 threads each). Consumer warpgroup c owns the
//     packed query rows [64c, 64c + 64) of the tile. cta_tile_q 128 -> kWG = 2 (the fast path);
//     cta_tile_q 64 -> kWG = 1. (cta_tile_q 16 runs the split-KV decode kernel, decode_hd256.cu.)
//   * Producer: loads Q once (all four warps, 16-byte cp.async), then K(j), V(j) for every 64-key tile j into
//     buffer j % 2 (2 K and 2 V buffers), waiting on the buffer's "empty" mbarrier (one arrival per consumer
//     warp) first. Two ways to copy a tile, chosen by the host per call:
//       - bulk tensor copies (TMA), for page_size 8, 16, 32 or a multiple of 64: the pool is a 4-D tensor map
//         {head dim, kv head, slot, page}; a tile is 64 / min(page_size, 64) chunks that each lie in one page,
//         and one copy per 64-column block of a chunk lands, 128-byte swizzled, where the consumers read it
//         (warp 0 copies K, warp 1 V; lane 4c + b issues chunk c, block b; 4-32 copies per tile). The buffer's
//         "full" mbarrier completes on the copies' byte count. Chunks reaching past the request's kv_len (the
//         last tile of a request only) are copied row by row by the warp, zeros past kv_len.
//       - 16-byte cp.async of every key row, its own page lookup (any page_size): each of the four warps copies
//         16 rows of K then of V, and "full" counts one cp.async.mbarrier.arrive.noinc per producer thread.
//     Both read only keys below kv_len (keys outside the tile's visible range are masked by the consumers).
//   * Consumers: S = Q K^T with 16 x wgmma m64n64k16 (A = Q, B = K, both from shared memory, K-major,
//     128-byte swizzle); online softmax in registers (fp32, exp2); P re-packed to bf16 A fragments in
//     registers; O += P V with 4 x wgmma m64n256k16 (A = P from registers, B = V from shared memory, MN-major
//     i.e. transpose-B). O is 64 x 256 fp32 per warpgroup = 128 registers per thread.
//   * Per tile the consumer issues S(j+1) = Q K(j+1)^T and O += P(j) V(j) back to back (two asynchronous commit
//     groups), waits for S(j+1) only, computes softmax(j+1) while PV(j) runs, then waits for PV(j) and rescales O
//     (FlashAttention-3's intra-warpgroup overlap). Two consumer warpgroups also ping-pong through two named
//     barriers (FlashAttention-3's warp-scheduler barrier), so one warpgroup's softmax overlaps the other's
//     GEMMs. cta_tile_q 128 uses setmaxnreg: 168 registers per thread at launch, producer 40, consumers 232.
//   * Shared memory (dynamic, base rounded up to 1024 B): Q [64*kWG rows], K [2][64], V [2][64], bf16, each
//     tile stored as four 64-column blocks (one per 128 bytes of a row); inside a block rows are 128 B apart
//     and 16-byte chunk c of row r sits at chunk c ^ (r & 7) -- exactly the canonical SWIZZLE_128B atom
//     (8 rows x 128 B = 1024 B) that the wgmma descriptors describe and the bulk copies write. 128-row tile:
//     Q 64 KB + K/V 128 KB + 1 KB alignment pad = 193 KB; 16/64-row tile: 32 KB + 128 KB + 1 KB = 161 KB. One
//     CTA per SM.
//   * KV tiles wholly left of the window are never read: the loop starts at the window's left edge of the
//     tile's first query row (rounded down to 64) and ends at the last query row's position; inside that range
//     the cp.async path zero-fills keys outside [left edge, last row's position] instead of reading them, the
//     bulk path reads them (they are below kv_len); only boundary tiles are masked.
//
// Plain CUDA C++, no torch headers. Compiles for sm_80 / sm_89 / sm_90a; the kernel body exists only where
// __CUDA_ARCH_FEAT_SM90_ALL is defined (sm_90a), elsewhere it is empty and the launcher refuses (-12).

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <math.h>
#include <atomic>
#include <string.h>

#include <cuda.h>          // CUtensorMap and its encoding enums (the driver is reached through the runtime)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "prefill_launch.cuh"      // status codes, PwPrefillParams, argument checks
#include "online_softmax.cuh"      // mask + online-softmax step shared with prefill_hd256.cu
#include "ptx_common.cuh"          // PTX helpers both prefill kernels use
#include "sm90_ptx.cuh"            // sm_90 PTX: mbarriers, bulk copies, named barriers, setmaxnreg, wgmma
#include "sm90_config.cuh"         // shapes, thread roles, named barriers, the shared-memory map and swizzle
#include "tile_geometry.cuh"       // a tile's rows and visible keys from the plan (shared with the other kernels)
#include "sm90_load_pipeline.cuh"  // the producer warpgroup: Q, then K/V tiles by bulk copy or cp.async


namespace pw_prefill_sm90 {

using namespace pw_ptx;
using pw_tile::qpos_of;
using pw_tile::TileGeometry;


// ------------------------------------------------------------------------------------------------ the kernel
#ifdef PW_SM90_DEVICE_CODE
// ============================================== consumer warpgroups ==============================================
// Consumer cw (0..kWG-1) owns packed rows [64 cw, 64 cw + 64) of the tile.
template <int kCtaQ, int kWG>
__device__ __forceinline__ void consumer(const Params& p, const Smem<kCtaQ, kWG>& sm) {
  using C = Cfg<kCtaQ, kWG>;
  const TileGeometry t = pw_tile::tile_geometry<kCtaQ, kKvTile>(p, blockIdx.x);
  const int kv_head = blockIdx.y;
  const int cw = (threadIdx.x >> 7) - 1;  // warpgroup 1 + cw
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;  // accumulator row within the warp's 16 rows (and g + 8)
  const int c4 = lane & 3;  // accumulator column pair
  const int group = p.group;
  const int wl = p.window_left;
  const int lrow0 =
      kWarpgroupRows * cw + kAccRowsPerWarp * warp + g;  // this thread's rows: lrow0 (index 0) and lrow0 + 8 (index 1)
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

  float o[kORegs];
#pragma unroll
  for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
  float s[kSRegs];                    // written by the first S wgmma of every tile (scale-d = 0)
  pw_softmax::OnlineSoftmax softmax;  // rows g and g + 8: running max and row sums

  // Issue (no fence, no commit) S = Q K^T for the tile in buffer st: 16 k-steps of 16 head dims, 64-column
  // block kk/4 and +32 B per k-step inside it. s[4n + e] = row (e < 2 ? g : g + 8) of the warp,
  // key kb + 8n + 2 c4 + (e & 1).
  auto gemm_s = [&](int st) {
    const uint32_t dk = dk0 + st * (kKvBytes >> 4);
    wgmma_m64n64k16_ss_first(s, make_desc(dq), make_desc(dk));
#pragma unroll
    for (int kk = 1; kk < 16; ++kk) {
      const uint32_t qo = (kk >> 2) * (C::kQBlockBytes >> 4) + (kk & 3) * 2;
      const uint32_t ko = (kk >> 2) * (kKvBlockBytes >> 4) + (kk & 3) * 2;
      wgmma_m64n64k16_ss_acc(s, make_desc(dq + qo), make_desc(dk + ko));
    }
  };
  // Issue (no fence, no commit) O += P V for the tile in buffer st: 4 k-steps of 16 keys = rows 16ks.. of V,
  // +2048 B each (two 8-key groups, SBO = 1024 B). o[4i + e] = row (e < 2 ? g : g + 8) of the warp,
  // head dim 8i + 2 c4 + (e & 1).
  uint32_t pf[4][4];  // P of the tile whose PV GEMM is issued next (bf16 wgmma A fragments)
  auto gemm_pv = [&](int st) {
    const uint32_t dv = dv0 + st * (kKvBytes >> 4);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      wgmma_m64n256k16_rs_tb(o, pf[ks][0], pf[ks][1], pf[ks][2], pf[ks][3], make_desc(dv + ks * (kVKStepBytes >> 4)));
    }
  };

  // Mask (boundary tiles only) and online softmax of tile j held in s (log2 domain): updates m and l, leaves
  // P(j) in s (fp32), and returns the factors alpha by which O must be rescaled before P(j) V(j) is added.
  // Neither O nor pf is touched here: a PV GEMM may still be reading pf and accumulating into O (ptxas
  // serialises every wgmma if a wgmma input register is written while any wgmma is in flight).
  auto softmax_p = [&](int j, float& alpha0, float& alpha1) {
    auto at = [&](int n, int e) -> float& { return s[4 * n + e]; };
    const int kb = t.kv_start + j * kKvTile;
    const bool full_tile = (kb + kKvTile - 1 <= wq_first) && (wl < 0 || kb >= wq_last - wl);
    if (!full_tile) pw_softmax::mask_tile(at, kb, c4, lo0, qp0, lo1, qp1);
    softmax.step(at, sl2, alpha0, alpha1);
  };
  // P (fp32, in s) -> bf16 wgmma A fragments in pf (same per-warp layout as mma.m16n8k16's A): k-step ks =
  // keys 16ks .. 16ks+15 = S n-tiles 2ks (keys +0..7) and 2ks+1 (keys +8..15). Only with no wgmma in flight.
  auto pack_p = [&]() {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      pf[ks][0] = pack_bf16x2(s[8 * ks + 0], s[8 * ks + 1]);  // row g,   keys 2c, 2c+1
      pf[ks][1] = pack_bf16x2(s[8 * ks + 2], s[8 * ks + 3]);  // row g+8, keys 2c, 2c+1
      pf[ks][2] = pack_bf16x2(s[8 * ks + 4], s[8 * ks + 5]);  // row g,   keys 8+2c, 8+2c+1
      pf[ks][3] = pack_bf16x2(s[8 * ks + 6], s[8 * ks + 7]);  // row g+8, keys 8+2c, 8+2c+1
    }
  };
  auto rescale_o = [&](float alpha0, float alpha1) {
#pragma unroll
    for (int n = 0; n < 32; ++n) {
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

  // Schedule (per consumer warpgroup; a "turn" = issuing GEMMs, passed between the two consumer warpgroups
  // through the named barriers kBarSched + cw):
  //   turn 0: S(0);  wait;  softmax(0) -> P(0)
  //   for j < n-1:  turn j+1: S(j+1), PV(j);  wait S(j+1);  softmax(j+1) -> P(j+1) while PV(j) runs;
  //                 wait PV(j);  rescale O
  //   turn n: PV(n-1);  wait
  // Each warpgroup takes n_tiles + 1 turns and passes the turn on after each, except consumer 1 after its
  // last (consumer 1's initial arrive gives consumer 0 its first turn), so every named-barrier generation gets
  // exactly 256 arrivals: 128 waiting threads + 128 arriving threads. No wgmma is in flight across a loop
  // edge or a conditional path (ptxas would otherwise serialise every wgmma); the last tile is peeled.
#pragma unroll
  for (int i = 0; i < kORegs; ++i) reg_fence(o[i]);  // materialise O = 0 before any wgmma is in flight
  mbar_wait<false>(sm.q_full(), 0);
  const int n_tiles = t.n_tiles;
  if (n_tiles > 0) {  // always true when rows_valid > 0; uniform across the CTA
    float alpha0, alpha1;
    // ---- turn 0: S(0)
    mbar_wait<false>(sm.full_k(0), 0);
    fence_proxy_async();
    if constexpr (kWG == 2) {
      if (cw == 1) named_bar_arrive(kBarSched + 0, kBarSchedThreads);
      named_bar_sync(kBarSched + cw, kBarSchedThreads);
    }
    wgmma_fence();
    gemm_s(0);
    wgmma_commit();
    if constexpr (kWG == 2) named_bar_arrive(kBarSched + (1 - cw), kBarSchedThreads);
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) reg_fence(s[i]);
    release(sm.empty_k(0));
    softmax_p(0, alpha0, alpha1);  // O is 0: no rescale needed
    pack_p();

#pragma unroll 1
    for (int j = 0; j < n_tiles - 1; ++j) {
      const int j1 = j + 1;
      mbar_wait<false>(sm.full_k(stage_of(j1)), parity_of(j1));
      mbar_wait<false>(sm.full_v(stage_of(j)), parity_of(j));
      fence_proxy_async();
      // ---- turn j+1: S(j+1), then PV(j) (two commit groups, in this order)
      if constexpr (kWG == 2) named_bar_sync(kBarSched + cw, kBarSchedThreads);
      wgmma_fence();
#pragma unroll
      for (int i = 0; i < kORegs; ++i) reg_fence(o[i]);
      gemm_s(stage_of(j1));
      wgmma_commit();
      gemm_pv(stage_of(j));
      wgmma_commit();
      if constexpr (kWG == 2) named_bar_arrive(kBarSched + (1 - cw), kBarSchedThreads);
      wgmma_wait<1>();  // S(j+1) has completed; PV(j) may still run
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) reg_fence(s[i]);
      softmax_p(j1, alpha0, alpha1);  // overlaps PV(j) on the tensor cores
      // Release K(j+1). The condition is always true (l0, l1 >= 0, or NaN), but it makes the arrive depend on
      // the softmax, which keeps ptxas from sinking the softmax below the wait for PV(j) (losing the overlap).
      __syncwarp();
      if (lane == 0 && !(softmax.l0 + softmax.l1 < 0.f)) mbar_arrive(sm.empty_k(stage_of(j1)));
      wgmma_wait<0>();  // PV(j) has completed
#pragma unroll
      for (int i = 0; i < kORegs; ++i) reg_fence(o[i]);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        reg_fence_u32(pf[ks][0]);
        reg_fence_u32(pf[ks][1]);
        reg_fence_u32(pf[ks][2]);
        reg_fence_u32(pf[ks][3]);
      }
      release(sm.empty_v(stage_of(j)));
      rescale_o(alpha0, alpha1);
      pack_p();
    }

    // ---- turn n: PV(n-1)
    mbar_wait<false>(sm.full_v(stage_of(n_tiles - 1)), parity_of(n_tiles - 1));
    fence_proxy_async();
    if constexpr (kWG == 2) named_bar_sync(kBarSched + cw, kBarSchedThreads);
    wgmma_fence();
#pragma unroll
    for (int i = 0; i < kORegs; ++i) reg_fence(o[i]);
    gemm_pv(stage_of(n_tiles - 1));
    wgmma_commit();
    if constexpr (kWG == 2) {
      if (cw == 0) named_bar_arrive(kBarSched + 1, kBarSchedThreads);
    }
    wgmma_wait<0>();
  }
#pragma unroll
  for (int i = 0; i < kORegs; ++i) reg_fence(o[i]);

  // ---- epilogue: normalise, stage this warpgroup's rows as bf16 in its own Q rows, copy out 16 B per lane
  float inv0, inv1;
  softmax.finalize(inv0, inv1);

  // Only this warpgroup's S GEMMs ever read its 64 Q rows; all of them have completed once all four warps
  // have passed this barrier.
  named_bar_sync(kBarEpilogue + cw, kWarpgroupThreads);
#pragma unroll
  for (int n = 0; n < 32; ++n) {
    // head dims 8n .. 8n+7 = 16-byte chunk n: block n / 8, chunk (n % 8) ^ (row % 8), row % 8 == g
    const uint32_t a = sm.q + (n >> 3) * C::kQBlockBytes + lrow0 * kBlockRowBytes + (((n & 7) ^ g) << 4) + c4 * 4;
    st_shared_b32(a, pack_bf16x2(o[4 * n + 0] * inv0, o[4 * n + 1] * inv0));
    st_shared_b32(a + 8 * kBlockRowBytes, pack_bf16x2(o[4 * n + 2] * inv1, o[4 * n + 3] * inv1));
  }
  __syncwarp();

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
#endif  // PW_SM90_DEVICE_CODE

// kTma: K/V tiles by bulk tensor copy through map_k / map_v (page_size 8, 16, 32 or a multiple of 64), else by
// cp.async (the maps are then unused).
template <int kCtaQ, int kWG, bool kTma>
__global__ void __launch_bounds__(Cfg<kCtaQ, kWG>::kThreads, Cfg<kCtaQ, kWG>::kMinBlocks)
    pw_prefill_hd256_sm90_kernel(const __grid_constant__ Params p, const __grid_constant__ CUtensorMap map_k,
                                 const __grid_constant__ CUtensorMap map_v) {
#ifdef PW_SM90_DEVICE_CODE
  using C = Cfg<kCtaQ, kWG>;
  // Static shared memory exists only in the sm_90a build: the host launcher checks for it (an empty kernel
  // from a compute_90 build without the arch-specific features has none).
  __shared__ __align__(8) unsigned long long bars[C::kNumBarriers];
  extern __shared__ __align__(16) unsigned char smem[];  // base rounded up to 1024 B at run time

  if (static_cast<int>(blockIdx.x) >= p.plan_scalars[2]) return;                      // grid x is a capacity
  if (pw_tile::tile_geometry<kCtaQ, kKvTile>(p, blockIdx.x).rows_valid <= 0) return;  // uniform across the CTA

  const Smem<kCtaQ, kWG> sm(smem, bars);
  if (threadIdx.x == 0) init_pipeline_barriers<kCtaQ, kWG, kTma>(sm);
  __syncthreads();

  if (threadIdx.x < kProducerThreads) {  // warpgroup 0
    if constexpr (C::kSetMaxNReg) setmaxnreg_dec<C::kProducerRegs>();
    if constexpr (kTma) {
      producer_tma<kCtaQ, kWG>(p, sm, &map_k, &map_v);
    } else {
      producer_cp_async<kCtaQ, kWG>(p, sm);
    }
  } else {
    if constexpr (C::kSetMaxNReg) setmaxnreg_inc<C::kConsumerRegs>();
    consumer<kCtaQ, kWG>(p, sm);
  }
#endif  // PW_SM90_DEVICE_CODE
}

// ------------------------------------------------------------------------------------------------ host side
constexpr int kMaxDevices = 64;

// Is this build's kernel usable on `device`? Device must be compute capability 9.0 and the kernel binary sm_90
// with the sm_90a body (it alone declares static shared memory). Both K/V copy instantiations of a tile come
// from one build, so the bulk-copy one stands for both. Cached per device id.
template <int kCtaQ, int kWG>
static int check_arch(int device) {
  static std::atomic<int> cache[kMaxDevices];  // 0 unknown, 1 usable, 2 not usable
  if (device >= 0 && device < kMaxDevices) {
    const int c = cache[device].load(std::memory_order_acquire);
    if (c == 1) return 0;
    if (c == 2) return PW_PREFILL_ERR_NOT_SM90;
  }
  int major = 0, minor = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (e != cudaSuccess) return static_cast<int>(e);
  bool usable = (major == 9 && minor == 0);
  if (usable) {
    cudaFuncAttributes attr;
    e = cudaFuncGetAttributes(&attr, pw_prefill_hd256_sm90_kernel<kCtaQ, kWG, true>);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // no kernel image for this device: clear it, report our own code
      usable = false;
    } else {
      usable = attr.binaryVersion / 10 == 9 && attr.sharedSizeBytes > 0;  // sm_90 code with the real body
    }
  }
  if (device >= 0 && device < kMaxDevices) cache[device].store(usable ? 1 : 2, std::memory_order_release);
  return usable ? 0 : PW_PREFILL_ERR_NOT_SM90;
}

// Opt the kernel into > 48 KB of dynamic shared memory once per device (a static flag per device id).
template <int kCtaQ, int kWG, bool kTma>
static int ensure_smem(int device) {
  static std::atomic<int> done[kMaxDevices];
  constexpr int bytes = static_cast<int>(Cfg<kCtaQ, kWG>::kSmemBytes);
  if (device >= 0 && device < kMaxDevices && done[device].load(std::memory_order_acquire)) return 0;
  int optin = 0;
  cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return static_cast<int>(e);
  // The static barriers (< 128 B) come on top of the dynamic bytes.
  if (optin < bytes + 128) return PW_PREFILL_ERR_SMEM_UNAVAILABLE;
  e = cudaFuncSetAttribute(pw_prefill_hd256_sm90_kernel<kCtaQ, kWG, kTma>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           bytes);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (device >= 0 && device < kMaxDevices) done[device].store(1, std::memory_order_release);
  return 0;
}

// cuTensorMapEncodeTiled from the driver the runtime has loaded (no link-time dependency on libcuda), looked up
// once; null when the driver does not provide it.
static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// Tensor maps for bulk copies of K (maps[0]) and V (maps[1]) tiles: the pool seen as the 4-D tensor
// {head dim 256, kv head, slot, page} (innermost first) from pool + k_offset / v_offset, strides 512 B,
// num_kv_heads * 512 B, page_stride * 2 B; box {64, 1, min(page_size, 64), 1}, 128-byte swizzle. The page
// extent is the int32 limit: page ids are int32 and checked against the pool before launch. The 16-byte
// alignment the maps need is pw_prefill_prepare's (-5). Returns false (use cp.async) when the page size is not
// 8, 16, 32 or a multiple of 64, or when the driver cannot encode the maps.
static bool encode_kv_maps(const void* pool, long long k_offset, long long v_offset, long long page_stride,
                           int page_size, int num_kv_heads, CUtensorMap* maps) {
  if (!(page_size % kKvTile == 0 || (kKvTile % page_size == 0 && page_size >= 8))) return false;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t elem = sizeof(__nv_bfloat16);
  const cuuint64_t dims[4] = {kPwPrefillHeadDim, static_cast<cuuint64_t>(num_kv_heads),
                              static_cast<cuuint64_t>(page_size), 0x7fffffffull};
  const cuuint64_t strides[3] = {kPwPrefillHeadDim * elem, num_kv_heads * kPwPrefillHeadDim * elem,
                                 static_cast<cuuint64_t>(page_stride) * elem};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(page_size < kKvTile ? page_size : kKvTile), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const long long offsets[2] = {k_offset, v_offset};
  for (int i = 0; i < 2; ++i) {
    void* base = const_cast<__nv_bfloat16*>(static_cast<const __nv_bfloat16*>(pool) + offsets[i]);
    const CUresult r = encode(&maps[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, base, dims, strides, box, unit,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return false;
  }
  return true;
}

template <int kCtaQ, int kWG, bool kTma>
static int start(const Params& p, const CUtensorMap (&maps)[2], int grid_tiles, int device, cudaStream_t stream) {
  using C = Cfg<kCtaQ, kWG>;
  const int rc = ensure_smem<kCtaQ, kWG, kTma>(device);
  if (rc != 0) return rc;
  const dim3 grid(static_cast<unsigned>(grid_tiles), static_cast<unsigned>(p.num_kv_heads), 1);
  pw_prefill_hd256_sm90_kernel<kCtaQ, kWG, kTma><<<grid, C::kThreads, C::kSmemBytes, stream>>>(p, maps[0], maps[1]);
  return static_cast<int>(cudaGetLastError());
}

// encode_kv_maps behind a small per-thread cache: a serving loop launches on the same pool and layer every step,
// and the maps depend only on these six values. Entries are replaced in turn.
static bool cached_kv_maps(const void* pool, long long k_offset, long long v_offset, long long page_stride,
                           int page_size, int num_kv_heads, CUtensorMap* maps) {
  constexpr int kEntries = 4;
  struct Entry {
    const void* pool;
    long long k_offset, v_offset, page_stride;
    int page_size, num_kv_heads;
    bool ok;
    CUtensorMap maps[2];
  };
  thread_local Entry cache[kEntries] = {};
  thread_local int next = 0;
  for (const Entry& e : cache) {
    if (e.pool == pool && e.pool != nullptr && e.k_offset == k_offset && e.v_offset == v_offset &&
        e.page_stride == page_stride && e.page_size == page_size && e.num_kv_heads == num_kv_heads) {
      memcpy(maps, e.maps, sizeof(e.maps));
      return e.ok;
    }
  }
  Entry& e = cache[next];
  next = (next + 1) % kEntries;
  e.ok = encode_kv_maps(pool, k_offset, v_offset, page_stride, page_size, num_kv_heads, e.maps);
  e.pool = pool;
  e.k_offset = k_offset;
  e.v_offset = v_offset;
  e.page_stride = page_stride;
  e.page_size = page_size;
  e.num_kv_heads = num_kv_heads;
  memcpy(maps, e.maps, sizeof(e.maps));
  return e.ok;
}

// The device/binary check (both instantiations of a tile come from one build), the empty-grid return, then the
// K/V copy path: bulk copies when the maps encode, else cp.async (the maps are then passed unused).
template <int kCtaQ, int kWG>
static int launch(const Params& p, int grid_tiles, int device, cudaStream_t stream) {
  const int rc = check_arch<kCtaQ, kWG>(device);
  if (rc != 0) return rc;
  if (grid_tiles == 0) return PW_PREFILL_OK;  // nothing to launch
  CUtensorMap maps[2];
  if (cached_kv_maps(p.pool, p.k_offset, p.v_offset, p.page_stride, p.page_size, p.num_kv_heads, maps)) {
    return start<kCtaQ, kWG, true>(p, maps, grid_tiles, device, stream);
  }
  memset(maps, 0, sizeof(maps));
  return start<kCtaQ, kWG, false>(p, maps, grid_tiles, device, stream);
}

}  // namespace pw_prefill_sm90

// Same parameter block and semantics as pw_prefill_hd256_bf16 (prefill_hd256.cu). Returns -12 (launching
// nothing) when the current device is not compute capability 9.0 or this library's kernel is not the sm_90a
// build; that check comes after the argument checks and before the grid_tiles == 0 early return.
extern "C" int pw_prefill_hd256_bf16_sm90(const PwPrefillLaunch* a, void* stream) {
  using namespace pw_prefill_sm90;
  Params p;
  const int status = pw_prefill_prepare(a, &p);
  if (status != PW_PREFILL_OK) return status;
  const int grid_tiles = a->grid_tiles;

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return static_cast<int>(e);
  switch (a->cta_tile_q) {
    case 16: {  // the split-KV decode kernel (decode_hd256.cu), behind the same device/binary check
      const int rc = check_arch<64, 1>(device);
      if (rc != 0) return rc;
      return grid_tiles == 0 ? PW_PREFILL_OK : pw_decode_hd256_launch(p, grid_tiles, s);
    }
    case 64: return launch<64, 1>(p, grid_tiles, device, s);
    default:  // 128
      return launch<128, 2>(p, grid_tiles, device, s);
  }
}

// How pw_prefill_hd256_bf16_sm90 copies K/V tiles for this pool and page size: 1 = bulk tensor copies (TMA),
// 0 = cp.async. (The same decision the launcher makes; it does not depend on the plan.)
extern "C" int pw_prefill_hd256_sm90_kv_copy_mode(const void* pool, long long k_offset, long long v_offset,
                                                  long long page_stride, int page_size, int num_kv_heads) {
  if (pool == nullptr || page_size < 1 || num_kv_heads < 1 || page_stride < 1) return 0;
  CUtensorMap maps[2];
  return pw_prefill_sm90::encode_kv_maps(pool, k_offset, v_offset, page_stride, page_size, num_kv_heads, maps) ? 1 : 0;
}

// Human-readable name of a status code returned by pw_prefill_hd256_bf16_sm90.
extern "C" const char* pw_prefill_hd256_sm90_error_string(int code) { return pw_prefill_status_string(code); }
