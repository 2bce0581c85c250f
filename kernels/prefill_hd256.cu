// pagedwindow: windowed paged prefill attention, head_dim 256, bf16 in/out.
//
// Semantics (docs/design.md §2):
//   query row j of request r sits at KV position q_pos = kv_len_r - seq_r + j (bottom-right causal);
//   key k (0 <= k < kv_len_r) is visible iff k <= q_pos and (window_left < 0 or q_pos - k <= window_left).
//   logits = sm_scale * q.k in fp32; softmax in fp32 (exp2 with log2(e) folded into the scale);
//   out = softmax . V accumulated in fp32, cast once to bf16. Optional natural-log LSE per (row, q head).
//
// Structure (FA2-class, mma.sync; the sm_90a wgmma kernel, prefill_hd256_sm90.cu, takes the same parameter
// block on Hopper):
//   * CTA = kWarps warps, each warp owns 16 packed (token, head-in-group) query rows; cta_tile_q = 16*kWarps
//     (64 or 128; cta_tile_q 16 runs the split-KV decode kernel, decode_hd256.cu).
//   * KV tile = 64 keys. Q, K and V live in dynamic shared memory, 512-byte rows, 16-byte chunks XOR-swizzled
//     by (row & 7) so that ldmatrix and cp.async are bank-conflict free.
//   * S = Q K^T and O += P V with mma.sync.m16n8k16 (bf16 -> fp32). Q fragments are re-read from shared
//     memory with ldmatrix every KV tile (holding them would cost 64 registers); K via ldmatrix, V via
//     ldmatrix.trans. P is re-packed from the S accumulators into A fragments in registers.
//   * kStages == 1: one K buffer and one V buffer; the load of V(j) overlaps S = Q K(j)^T and the softmax,
//     the load of K(j+1) overlaps O += P V(j) (FlashAttention-2's schedule). 96 KB at 64 rows, so two CTAs
//     share an SM on H100/H200 (228 KB per SM), and it fits sm_86/sm_89 (99 KB per block).
//     kStages == 2: K and V both double-buffered; tile j+1 is loaded while tile j is computed. 160 KB at 64
//     rows: one CTA per SM; fits sm_80 and sm_90 only.
//     The 64-row launcher picks per device (PW_PREFILL_KV_STAGES=0, the default): 1 where two 1-stage CTAs
//     fit in one SM's shared memory (H100/H200), else 2 where it fits (A100: one CTA per SM either way),
//     else 1. -DPW_PREFILL_KV_STAGES=1 or =2 forces one schedule (for benchmarking).
//   * KV tiles wholly left of the window are never read: the loop starts at the window's left edge of the
//     tile's first query row (rounded down to 64) and ends at the last query row's position. Keys outside
//     [that left edge, last row's position] are zero-filled instead of read; only boundary tiles are masked.
//
// Plain CUDA C++, no torch headers. Targets: sm_80, sm_89, sm_90a.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <math.h>
#include <atomic>

#include "prefill_launch.cuh"  // status codes, PwPrefillParams, argument checks
#include "online_softmax.cuh"  // mask + online-softmax step shared with the sm_90a kernel
#include "ptx_common.cuh"      // PTX helpers both prefill kernels use
#include "tile_geometry.cuh"   // a tile's rows and visible keys from the plan (shared with the other kernels)

// K/V buffering of the 64-row tile: 0 = choose per device (default), 1 or 2 = force.
#ifndef PW_PREFILL_KV_STAGES
#define PW_PREFILL_KV_STAGES 0
#endif
#if PW_PREFILL_KV_STAGES != 0 && PW_PREFILL_KV_STAGES != 1 && PW_PREFILL_KV_STAGES != 2
#error "PW_PREFILL_KV_STAGES must be 0 (auto), 1 or 2"
#endif


namespace pw_prefill {

using namespace pw_ptx;
using pw_tile::qpos_of;
using pw_tile::TileGeometry;

constexpr int kHeadDim = kPwPrefillHeadDim;
constexpr int kKvTile = 64;                    // keys per KV tile
constexpr int kRowBytes = kHeadDim * 2;        // 512 bytes per bf16 row
constexpr int kChunksPerRow = kRowBytes / 16;  // 32 sixteen-byte chunks: one warp copies one row per step
static_assert(kChunksPerRow == 32, "the loaders map one lane to one 16-byte chunk of a row");

using Params = PwPrefillParams;

// ------------------------------------------------------------------------------------- shared-memory layout

// Byte offset of 16-byte chunk `chunk` (0..31) of row `row` in a swizzled 512-byte-row tile.
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

// ------------------------------------------------------------------------------------------- KV tile loader
// Warp w copies rows w, w + kWarps, w + 2*kWarps, ... of a 64-key tile; lane l copies chunk l of each row.
// The per-row element offset inside the pool (page * page_stride + (slot * Hkv + kv_head) * 256, or -1 when
// the key is outside [kv_lo, kv_hi)) is computed once per row by one lane and broadcast with shuffles.
template <int kWarps>
struct KvRows {
  static constexpr int kRowsPerWarp = kKvTile / kWarps;
  static constexpr int kRegs = (kRowsPerWarp + 31) / 32;
  long long off[kRegs];

  __device__ __forceinline__ void compute(const Params& p, int kb, int kv_lo, int kv_hi, int page_base, int kv_head,
                                          int warp, int lane) {
#pragma unroll
    for (int o = 0; o < kRegs; ++o) {
      const int it = lane + 32 * o;
      const int pos = kb + warp + it * kWarps;
      long long v = -1;
      if (it < kRowsPerWarp && pos >= kv_lo && pos < kv_hi) {
        const int pi = pos / p.page_size;
        const int slot = pos - pi * p.page_size;
        const int page = __ldg(p.page_indices + page_base + pi);
        v = static_cast<long long>(page) * p.page_stride +
            static_cast<long long>(slot * p.num_kv_heads + kv_head) * kHeadDim;
      }
      off[o] = v;
    }
  }

  // Issue the cp.async copies of one 64 x 256 tile (K when base == k_offset, V when base == v_offset).
  __device__ __forceinline__ void issue(const Params& p, uint32_t s_tile, long long base, int warp, int lane) const {
    constexpr int kInner = kRowsPerWarp < 32 ? kRowsPerWarp : 32;
    const __nv_bfloat16* pool_lane = p.pool + base + lane * 8;
#pragma unroll
    for (int o = 0; o < kRegs; ++o) {
#pragma unroll 4
      for (int i = 0; i < kInner; ++i) {
        const long long row_off = __shfl_sync(0xffffffffu, off[o], i);
        const int r = warp + (32 * o + i) * kWarps;
        const bool valid = row_off >= 0;
        const void* src = valid ? static_cast<const void*>(pool_lane + row_off) : static_cast<const void*>(p.pool);
        cp_async_16(s_tile + swz(r, lane), src, valid ? 16 : 0);
      }
    }
  }
};

// ------------------------------------------------------------------------------------------------ the kernel
template <int kWarps, int kStages>
__global__ void __launch_bounds__(kWarps * 32, (kWarps == 4 ? 2 : 1)) pw_prefill_hd256_kernel(const Params p) {
  constexpr int kCtaQ = 16 * kWarps;
  constexpr uint32_t kQBytes = kCtaQ * kRowBytes;
  constexpr uint32_t kKvBytes = kKvTile * kRowBytes;  // 32 KB

  extern __shared__ __align__(128) unsigned char smem[];

  const int tile = blockIdx.x;
  if (tile >= p.plan_scalars[2]) return;  // grid x is a capacity; the real tile count lives on the device
  const int kv_head = blockIdx.y;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  // ---- tile geometry (uniform across the CTA)
  TileGeometry t = pw_tile::tile_rows<kCtaQ>(p, tile);
  if (t.rows_valid <= 0) return;
  pw_tile::tile_keys<kKvTile>(p, t);
  const int group = t.group;
  const int wl = t.window_left;

  // ---- shared memory carve-up: Q | K[kStages] | V[kStages]
  const uint32_t sQ = smem_addr(smem);
  const uint32_t sK = sQ + kQBytes;
  const uint32_t sV = sK + kStages * kKvBytes;

  // ---- Q tile -> shared (rows past rows_valid are zero-filled)
#pragma unroll 4
  for (int it = 0; it < kCtaQ / kWarps; ++it) {
    const int r = warp + it * kWarps;
    const bool valid = r < t.rows_valid;
    const void* src = p.q;
    if (valid) {
      const int pr = t.row0 + r;
      const int tok = pr / group;
      const int head = kv_head * group + (pr - tok * group);
      src = p.q + (static_cast<long long>(t.qo_begin + tok) * p.num_qo_heads + head) * kHeadDim + lane * 8;
    }
    cp_async_16(sQ + swz(r, lane), src, valid ? 16 : 0);
  }

  KvRows<kWarps> rows;
  if (t.n_tiles > 0) {
    rows.compute(p, t.kv_start, t.kv_lo, t.kv_hi, t.page_base, kv_head, warp, lane);
    rows.issue(p, sK, p.k_offset, warp, lane);
    if constexpr (kStages == 2) rows.issue(p, sV, p.v_offset, warp, lane);
  }
  cp_async_commit();

  // ---- per-lane fragment addressing (see README: ldmatrix lane -> row/chunk maps)
  const int g = lane >> 2;  // accumulator row within the warp's 16 rows (and g + 8)
  const int c4 = lane & 3;  // accumulator column pair
  const int l7 = lane & 7;
  const int b3 = (lane >> 3) & 1;
  const int b4 = (lane >> 4) & 1;
  uint32_t q_off[4], k_off[4], v_off[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // Q (A operand): lane -> row (lane & 15), chunk 2*kk + b4.
    q_off[i] = sQ + (warp * 16 + (lane & 15)) * kRowBytes + (((2 * i) ^ (b4 ^ l7)) << 4);
    // K (B operand, non-trans): lane -> key 8*b4 + l7, chunk 2*kk + b3.
    k_off[i] = (b4 * 8 + l7) * kRowBytes + (((2 * i) ^ (b3 ^ l7)) << 4);
    // V (B operand, trans): lane -> key 8*b3 + l7, chunk 2*dp + b4.
    v_off[i] = (b3 * 8 + l7) * kRowBytes + (((2 * i) ^ (b4 ^ l7)) << 4);
  }

  // ---- per-thread query rows: packed rows warp*16 + g (index 0) and warp*16 + g + 8 (index 1)
  const int prow0 = t.row0 + warp * 16 + g;
  const int qp0 = qpos_of(t, group, prow0);
  const int qp1 = qpos_of(t, group, prow0 + 8);
  const int lo0 = (wl >= 0) ? qp0 - wl : 0;
  const int lo1 = (wl >= 0) ? qp1 - wl : 0;
  const float sl2 = p.scale_log2;

  float o[32][4];
#pragma unroll
  for (int n = 0; n < 32; ++n) {
    o[n][0] = 0.f;
    o[n][1] = 0.f;
    o[n][2] = 0.f;
    o[n][3] = 0.f;
  }
  pw_softmax::OnlineSoftmax softmax;  // rows g and g + 8: running max and row sums

  for (int j = 0; j < t.n_tiles; ++j) {
    const int kb = t.kv_start + j * kKvTile;
    const uint32_t kbuf = sK + ((kStages == 2) ? (j & 1) * kKvBytes : 0u);
    const uint32_t vbuf = sV + ((kStages == 2) ? (j & 1) * kKvBytes : 0u);

    cp_async_wait<0>();
    __syncthreads();  // K(j) (and Q) visible; every warp is done with the buffers about to be refilled
    if constexpr (kStages == 1) {
      rows.issue(p, sV, p.v_offset, warp, lane);  // V(j): same rows as K(j)
      cp_async_commit();
    } else {
      if (j + 1 < t.n_tiles) {
        const uint32_t nb = ((j + 1) & 1) * kKvBytes;
        rows.compute(p, kb + kKvTile, t.kv_lo, t.kv_hi, t.page_base, kv_head, warp, lane);
        rows.issue(p, sK + nb, p.k_offset, warp, lane);
        rows.issue(p, sV + nb, p.v_offset, warp, lane);
      }
      cp_async_commit();
    }

    // ---- S = Q K^T: 16 rows x 64 keys per warp; s[n] covers keys kb + 8n .. kb + 8n + 7
    float s[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      s[n][0] = 0.f;
      s[n][1] = 0.f;
      s[n][2] = 0.f;
      s[n][3] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      uint32_t a0, a1, a2, a3;
      ldsm_x4(a0, a1, a2, a3, q_off[kk & 3] + (kk >> 2) * 128);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(b0, b1, b2, b3, kbuf + k_off[kk & 3] + (kk >> 2) * 128 + np * 16 * kRowBytes);
        mma_bf16_16816(s[2 * np], a0, a1, a2, a3, b0, b1);
        mma_bf16_16816(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
      }
    }

    // ---- mask boundary tiles only, then the online softmax (log2 domain): s becomes P
    auto at = [&](int n, int e) -> float& { return s[n][e]; };
    const bool full_tile = (kb + kKvTile - 1 <= t.qpos_first) && (wl < 0 || kb >= t.qpos_last - wl);
    if (!full_tile) pw_softmax::mask_tile(at, kb, c4, lo0, qp0, lo1, qp1);
    float alpha0, alpha1;
    softmax.step(at, sl2, alpha0, alpha1);
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      o[n][0] *= alpha0;
      o[n][1] *= alpha0;
      o[n][2] *= alpha1;
      o[n][3] *= alpha1;
    }
    // P as A fragments: k-step ks covers keys 16*ks .. 16*ks + 15 = S n-tiles 2ks (cols 0-7), 2ks+1 (8-15).
    uint32_t pf[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      pf[ks][0] = pack_bf16x2(s[2 * ks][0], s[2 * ks][1]);          // row g,   keys 2c, 2c+1
      pf[ks][1] = pack_bf16x2(s[2 * ks][2], s[2 * ks][3]);          // row g+8, keys 2c, 2c+1
      pf[ks][2] = pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]);  // row g,   keys 8+2c, 8+2c+1
      pf[ks][3] = pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3]);  // row g+8, keys 8+2c, 8+2c+1
    }

    if constexpr (kStages == 1) {
      cp_async_wait<0>();
      __syncthreads();  // V(j) visible; every warp is done reading K(j)
      if (j + 1 < t.n_tiles) {
        rows.compute(p, kb + kKvTile, t.kv_lo, t.kv_hi, t.page_base, kv_head, warp, lane);
        rows.issue(p, sK, p.k_offset, warp, lane);  // K(j+1) overlaps O += P V(j)
      }
      cp_async_commit();
    }

    // ---- O += P V: o[n] covers head dims 8n .. 8n + 7
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
      for (int dp = 0; dp < 16; ++dp) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_trans(b0, b1, b2, b3, vbuf + v_off[dp & 3] + (dp >> 2) * 128 + ks * 16 * kRowBytes);
        mma_bf16_16816(o[2 * dp], pf[ks][0], pf[ks][1], pf[ks][2], pf[ks][3], b0, b1);
        mma_bf16_16816(o[2 * dp + 1], pf[ks][0], pf[ks][1], pf[ks][2], pf[ks][3], b2, b3);
      }
    }
  }

  // ---- epilogue: normalise, stage the warp's 16 rows as bf16 in its own Q rows, copy out 16 B per lane
  cp_async_wait<0>();
  __syncthreads();  // no copy may still be landing in shared memory (covers n_tiles == 0)

  float inv0, inv1;
  softmax.finalize(inv0, inv1);

  // Only this warp ever reads its 16 Q rows, so it may overwrite them now.
  store_acc_rows_bf16(sQ, warp * 16, o, inv0, inv1, g, c4);
  __syncwarp();

  if (p.lse != nullptr && c4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + g + 8 * h;
      if (r < t.rows_valid) {
        const int pr = t.row0 + r;
        const int tok = pr / group;
        const int head = kv_head * group + (pr - tok * group);
        p.lse[static_cast<long long>(t.qo_begin + tok) * p.num_qo_heads + head] = softmax.lse(h);
      }
    }
  }

#pragma unroll 4
  for (int i = 0; i < 16; ++i) {
    const int r = warp * 16 + i;
    if (r < t.rows_valid) {
      const int pr = t.row0 + r;
      const int tok = pr / group;
      const int head = kv_head * group + (pr - tok * group);
      const uint4 v = ld_shared_v4(sQ + swz(r, lane));
      __nv_bfloat16* dst =
          p.out + (static_cast<long long>(t.qo_begin + tok) * p.num_qo_heads + head) * kHeadDim + lane * 8;
      *reinterpret_cast<uint4*>(dst) = v;
    }
  }
}

template <int kWarps, int kStages>
constexpr int smem_bytes() {
  return (16 * kWarps + 2 * kStages * kKvTile) * kRowBytes;
}

constexpr int kMaxDevices = 64;

// Opt the kernel into > 48 KB of dynamic shared memory once per device (a static flag per device id).
template <int kWarps, int kStages>
static int ensure_smem(int device) {
  static std::atomic<int> done[kMaxDevices];
  constexpr int bytes = smem_bytes<kWarps, kStages>();
  if (device >= 0 && device < kMaxDevices && done[device].load(std::memory_order_acquire)) return 0;
  int optin = 0;
  cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (optin < bytes) return PW_PREFILL_ERR_SMEM_UNAVAILABLE;
  e = cudaFuncSetAttribute(pw_prefill_hd256_kernel<kWarps, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           bytes);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (device >= 0 && device < kMaxDevices) done[device].store(1, std::memory_order_release);
  return 0;
}

// K/V stages for the 64-row tile on this device (cached per device id; see the header comment).
static int stages_for_device(int device, int* stages) {
  static std::atomic<int> cache[kMaxDevices];
  if (PW_PREFILL_KV_STAGES != 0) {
    *stages = PW_PREFILL_KV_STAGES;
    return 0;
  }
  if (device >= 0 && device < kMaxDevices) {
    const int c = cache[device].load(std::memory_order_acquire);
    if (c != 0) {
      *stages = c;
      return 0;
    }
  }
  int optin = 0, per_sm = 0, reserved = 0;
  cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device);
  if (e != cudaSuccess) return static_cast<int>(e);
  int s = 1;
  if (2LL * (smem_bytes<4, 1>() + reserved) > per_sm && optin >= smem_bytes<4, 2>()) s = 2;
  if (device >= 0 && device < kMaxDevices) cache[device].store(s, std::memory_order_release);
  *stages = s;
  return 0;
}

template <int kWarps, int kStages>
static int launch(const Params& p, int grid_tiles, int device, cudaStream_t stream) {
  const int rc = ensure_smem<kWarps, kStages>(device);
  if (rc != 0) return rc;
  const dim3 grid(static_cast<unsigned>(grid_tiles), static_cast<unsigned>(p.num_kv_heads), 1);
  pw_prefill_hd256_kernel<kWarps, kStages><<<grid, kWarps * 32, smem_bytes<kWarps, kStages>(), stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace pw_prefill

// Validate `a` (PwPrefillLaunch, prefill_launch.cuh), then launch on `stream`. Returns 0, a negative status
// (nothing launched) or a cudaError_t.
extern "C" int pw_prefill_hd256_bf16(const PwPrefillLaunch* a, void* stream) {
  using namespace pw_prefill;
  Params p;
  const int status = pw_prefill_prepare(a, &p);
  if (status != PW_PREFILL_OK) return status;
  const int grid_tiles = a->grid_tiles;
  if (grid_tiles == 0) return PW_PREFILL_OK;  // nothing to launch

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return static_cast<int>(e);
  switch (a->cta_tile_q) {
    case 16:
      return pw_decode_hd256_launch(p, grid_tiles, a->max_tile_splits,
                                    s);  // the split-KV decode kernel (decode_hd256.cu)
    case 64: {
      int stages = 1;
      const int rc = stages_for_device(device, &stages);
      if (rc != 0) return rc;
#if PW_PREFILL_KV_STAGES != 2
      if (stages == 1) return launch<4, 1>(p, grid_tiles, device, s);
#endif
#if PW_PREFILL_KV_STAGES != 1
      if (stages == 2) return launch<4, 2>(p, grid_tiles, device, s);
#endif
      return PW_PREFILL_ERR_SMEM_UNAVAILABLE;  // unreachable
    }
    default:  // 128
      return launch<8, 1>(p, grid_tiles, device, s);
  }
}

// sizeof(PwPrefillLaunch), for the host's check of its mirror of the struct.
extern "C" int pw_prefill_launch_size(void) { return static_cast<int>(sizeof(PwPrefillLaunch)); }

// Human-readable name of a status code returned by pw_prefill_hd256_bf16.
extern "C" const char* pw_prefill_hd256_error_string(int code) { return pw_prefill_status_string(code); }
