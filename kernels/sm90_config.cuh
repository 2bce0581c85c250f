// pagedwindow: the Hopper prefill kernel's (prefill_hd256_sm90.cu) compile-time configuration: tile shapes and
// byte sizes, the warpgroup roles' thread counts and register budgets, the named barrier ids, the shared-memory
// map with its mbarriers, and the 128-byte swizzle every Q / K / V tile is stored in.
//
// Shared memory (dynamic, base rounded up to the 1024-byte swizzle atom): Q [64 * kWG rows] | K [kStages][64] |
// V [kStages][64], bf16. A tile of R rows is four 64-column blocks (one per 128 bytes of a row) of R rows 128 B
// apart; inside a block 16-byte chunk c of row r sits at chunk c ^ (r & 7): the canonical SWIZZLE_128B layout
// (atom 8 rows x 128 B = 1024 B) that the wgmma descriptors describe and the bulk tensor copies write.
// 128-row tile: Q 64 KB + K/V 128 KB + 1 KB alignment pad = 193 KB; 64-row tile: 32 KB + 128 KB + 1 KB = 161 KB.
// One CTA per SM.
#pragma once

#include <stdint.h>

#include "prefill_launch.cuh"  // PwPrefillParams, kPwPrefillHeadDim
#include "ptx_common.cuh"      // smem_addr
#include "sm90_ptx.cuh"        // PW_SM90_DEVICE_CODE

namespace pw_prefill_sm90 {

using Params = PwPrefillParams;

// ----------------------------------------------------------------------------------------- build switches
// Q by bulk tensor copy (1, the default): a consumer warpgroup's 64 Q rows, when all of them are the tile's and the
// host gave a map of q, come in by four bulk tensor copies; 0: every Q row by cp.async.
#ifndef PW_SM90_Q_BULK
#define PW_SM90_Q_BULK 1
#endif

// O's staging in the epilogue (2, the default): by stmatrix, and a consumer warpgroup whose rows go out by bulk
// tensor copies issues each 64-column block's copy as soon as that block is staged; 1: by stmatrix, every block
// staged before the copies; 0: by 32-bit shared stores, every block staged before the copies.
#ifndef PW_SM90_O_STAGING
#define PW_SM90_O_STAGING 2
#endif

// The consumers' schedule. PW_SM90_PINGPONG (1, the default): two consumer warpgroups take turns issuing their
// GEMMs (FlashAttention-3's warp-scheduler barrier); 0: each issues as soon as its data is ready (run 150: level).
#ifndef PW_SM90_PINGPONG
#define PW_SM90_PINGPONG 1
#endif

// Measurement builds of the loop, not attention (time them with variant_ab.py --unchecked):
// PW_SM90_PROBE_NO_SOFTMAX=1 skips the mask and the online softmax (P is S itself, O is never rescaled);
// PW_SM90_PROBE_NO_RESCALE=1 keeps the softmax and drops O's rescale (the factors forced to 1);
// PW_SM90_PROBE_HALF_S=1 runs 8 of S's 16 k-steps (head dims 0..127). How much each takes off the loop says how
// much of it the softmax, the rescale and S's GEMM hold on the critical path.
#ifndef PW_SM90_PROBE_NO_SOFTMAX
#define PW_SM90_PROBE_NO_SOFTMAX 0
#endif
#ifndef PW_SM90_PROBE_NO_RESCALE
#define PW_SM90_PROBE_NO_RESCALE 0
#endif
#ifndef PW_SM90_PROBE_HALF_S
#define PW_SM90_PROBE_HALF_S 0
#endif

// ------------------------------------------------------------------------------------------- shapes and bytes
constexpr int kHeadDim = kPwPrefillHeadDim;                   // 256
constexpr int kRowBytes = kHeadDim * 2;                       // one bf16 row of Q, K or V: 512 B
constexpr int kChunkElems = 8;                                // bf16 per 16-byte chunk (one cp.async, one lane)
constexpr int kBlockCols = 64;                                // head dims per 64-column block
constexpr int kBlockRowBytes = kBlockCols * 2;                // a row inside a block: 128 B, the swizzle's pitch
constexpr int kSwizzleAtomBytes = 8 * kBlockRowBytes;         // 8 rows x 128 B: the alignment of every tile
constexpr int kKvTile = 64;                                   // keys per KV tile
constexpr uint32_t kKvBytes = kKvTile * kRowBytes;            // one K or V tile: 32 KB
constexpr uint32_t kKvBlockBytes = kKvTile * kBlockRowBytes;  // one 64-column block of a K/V tile: 8 KB
constexpr uint32_t kVKStepBytes = 16 * kBlockRowBytes;        // V rows of one PV k-step (16 keys): 2 KB
constexpr int kStages = 2;                                    // K buffers, and as many V buffers
constexpr uint32_t kMbarBytes = 8;                            // one mbarrier (a shared-memory b64)

// -------------------------------------------------------------------------------------------------- threads
constexpr int kWarpgroupThreads = 128;
constexpr int kWarpgroupWarps = 4;
constexpr int kWarpgroupRows = 64;                   // query rows of a consumer warpgroup: the M of wgmma m64nNk16
constexpr int kProducerThreads = kWarpgroupThreads;  // warpgroup 0 loads; warpgroups 1 .. kWG compute
constexpr int kKvRowsPerWarp = kKvTile / kWarpgroupWarps;          // cp.async producer: key rows a warp copies per tile
constexpr int kAccRowsPerWarp = kWarpgroupRows / kWarpgroupWarps;  // wgmma accumulator rows a warp holds: 16
// Accumulators per consumer thread: O (64 x 256 fp32) and S (64 x 64 fp32) over the warpgroup's 128 threads.
constexpr int kORegs = kWarpgroupRows * kHeadDim / kWarpgroupThreads;  // 128
constexpr int kSRegs = kWarpgroupRows * kKvTile / kWarpgroupThreads;   // 32
constexpr int kRegisterFile = 65536;                                   // 32-bit registers per SM

// Named barriers (bar.sync / bar.arrive ids; 0 is __syncthreads). For consumer warpgroup c (0 or 1):
//   kBarSched + c (1, 2): "consumer c may issue its GEMMs", the ping-pong of the 128-row tile; both consumer
//     warpgroups' threads take part (kBarSchedThreads);
//   kBarEpilogue + c (3, 4): consumer c's own four warps, before its epilogue overwrites its Q rows.
constexpr int kBarSched = 1;
constexpr int kBarEpilogue = 3;
constexpr int kBarSchedThreads = 2 * kWarpgroupThreads;

// Compile-time configuration of one kernel instantiation: a tile of kCtaQ packed query rows, kWG consumer
// warpgroups.
template <int kCtaQ, int kWG>
struct Cfg {
  static_assert(kWG == 1 || kWG == 2, "one or two consumer warpgroups");
  static_assert(kCtaQ >= 1 && kCtaQ <= kWarpgroupRows * kWG, "the consumer warpgroups must cover the tile");
  static constexpr int kThreads = kProducerThreads + kWarpgroupThreads * kWG;
  static constexpr int kRowsQ = kWarpgroupRows * kWG;                // Q rows held in shared memory
  static constexpr uint32_t kQBlockBytes = kRowsQ * kBlockRowBytes;  // one 64-column block of Q
  static constexpr uint32_t kQBytes = kRowsQ * kRowBytes;
  // + 1 KB alignment pad
  static constexpr uint32_t kSmemBytes = kSwizzleAtomBytes + kQBytes + 2u * kStages * kKvBytes;
  static constexpr int kMinBlocks = 1;
  // Two consumer warpgroups + the producer (384 threads) get 168 registers each at launch; setmaxnreg moves
  // them to the consumers (FlashAttention-3's split for a cp.async producer): 128 * 40 + 256 * 232 = 64512.
  // One consumer warpgroup (256 threads) has 255 registers per thread anyway: no setmaxnreg.
  static constexpr bool kSetMaxNReg = (kWG == 2);
  static constexpr uint32_t kProducerRegs = 40;
  static constexpr uint32_t kConsumerRegs = 232;
  static_assert(!kSetMaxNReg ||
                    kProducerThreads * kProducerRegs + kWarpgroupThreads * kWG * kConsumerRegs <= kRegisterFile,
                "setmaxnreg budget exceeds the register file");
  // q_full, full_k[], full_v[], empty_k[], empty_v[], overlap_anchor
  static constexpr int kNumBarriers = 1 + 4 * kStages + 1;
};

#ifdef PW_SM90_DEVICE_CODE
using namespace pw_ptx;

// Byte offset of 16-byte chunk `chunk` (0..31) of row `row` in a tile of kRows rows stored as four
// 64-column SWIZZLE_128B blocks (block = chunk / 8, rows 128 B apart, chunk (chunk % 8) ^ (row % 8)).
template <int kRows>
__device__ __forceinline__ uint32_t sw128(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * (kRows * kBlockRowBytes) + row * kBlockRowBytes +
                               (((chunk & 7) ^ (row & 7)) << 4));
}

// Shared-memory map of one CTA (byte addresses in the shared window).
template <int kCtaQ, int kWG>
struct Smem {
  uint32_t q, k, v;  // Q | K[kStages] | V[kStages], q aligned to 1024 B (the swizzle atom)
  uint32_t bar;      // q_full, full_k[kStages], full_v[kStages], empty_k[kStages], empty_v[kStages], overlap_anchor
                     // (8 B each)
  __device__ __forceinline__ Smem(const void* dyn, const void* bars) {
    q = (smem_addr(dyn) + (kSwizzleAtomBytes - 1u)) & ~(kSwizzleAtomBytes - 1u);
    k = q + Cfg<kCtaQ, kWG>::kQBytes;
    v = k + kStages * kKvBytes;
    bar = smem_addr(bars);
  }
  __device__ __forceinline__ uint32_t q_full() const { return bar; }
  __device__ __forceinline__ uint32_t full_k(int s) const { return bar + kMbarBytes * (1 + s); }
  __device__ __forceinline__ uint32_t full_v(int s) const { return bar + kMbarBytes * (1 + kStages + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return bar + kMbarBytes * (1 + 2 * kStages + s); }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return bar + kMbarBytes * (1 + 3 * kStages + s); }
  // Arrived on, never waited on: an arrive that depends on the softmax pins it above the wait for PV(j)
  // (sm90_consumer.cuh). Count 1: every arrival completes a phase, which nothing observes.
  __device__ __forceinline__ uint32_t overlap_anchor() const { return bar + kMbarBytes * (1 + 4 * kStages); }
};

// Q rows that come by bulk tensor copy: the whole consumer warpgroups whose 64 rows are all the tile's (a prefix of
// the tile's rows), none without a map of q (q_bulk false) or in a PW_SM90_Q_BULK=0 build.
template <int kCtaQ, int kWG>
__device__ __forceinline__ int q_bulk_rows(int rows_valid, bool q_bulk) {
  if (!PW_SM90_Q_BULK || !q_bulk) return 0;
  return min(rows_valid, Cfg<kCtaQ, kWG>::kRowsQ) / kWarpgroupRows * kWarpgroupRows;
}

// Buffer of KV tile j, and the parity of the mbarrier phase of that buffer's use by tile j (its use j / kStages).
__device__ __forceinline__ int stage_of(int j) { return j % kStages; }
__device__ __forceinline__ uint32_t parity_of(int j) { return static_cast<uint32_t>((j / kStages) & 1); }
#endif  // PW_SM90_DEVICE_CODE

}  // namespace pw_prefill_sm90
