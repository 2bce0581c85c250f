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
// Structure (FlashAttention-3-like, warp-specialised), one header per piece:
//   * CTA = 1 producer warpgroup + kWG consumer warpgroups (128 threads each); consumer warpgroup c owns the
//     packed query rows [64c, 64c + 64) of the tile. cta_tile_q 128 -> kWG = 2 (the fast path), 64 -> kWG = 1
//     (cta_tile_q 16 runs the split-KV decode kernel, decode_hd256.cu). 128-row tiles use setmaxnreg: 168
//     registers per thread at launch, producer 40, consumers 232. Shapes, register budgets, named barriers,
//     the shared-memory map and the 128-byte swizzle: sm90_config.cuh.
//   * Producer (sm90_load_pipeline.cuh): Q once (whole warpgroups' rows by bulk tensor copies through a map of
//     q, other rows by cp.async), then K(j), V(j) of every 64-key tile j into
//     stage j % 2 behind "empty" / "full" mbarriers, by bulk tensor copies (page_size 8, 16, 32 or a multiple
//     of 64) or by cp.async (any page_size), chosen by the host per call.
//   * Consumers (sm90_consumer.cuh): S = Q K^T (wgmma m64n64k16, both operands in shared memory), the mask and
//     online softmax (online_softmax.cuh, shared with the other kernels), O += P V (wgmma m64n256k16, P from
//     registers); S(j+1) and PV(j) are issued together and softmax(j+1) overlaps PV(j); two consumer
//     warpgroups ping-pong through named barriers. Epilogue (sm90_epilogue.cuh): O / l to bf16 through shared
//     memory (written out by bulk tensor copies for whole warpgroups, row by row otherwise), and the LSE.
//   * KV tiles wholly left of the window are never read (tile_geometry.cuh, shared with prefill_hd256.cu): the
//     loop starts at the window's left edge of the tile's first query row (rounded down to 64) and ends at the
//     last query row's position; only boundary tiles are masked.
//   * PTX wrappers (mbarriers, bulk copies, named barriers, setmaxnreg, wgmma): sm90_ptx.cuh.
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
#include "online_softmax.cuh"      // mask + OnlineSoftmax, shared with prefill_hd256.cu and decode_hd256.cu
#include "tile_geometry.cuh"       // a tile's rows and visible keys from the plan, shared with prefill_hd256.cu
#include "sm90_ptx.cuh"            // sm_90 PTX: mbarriers, bulk copies, named barriers, setmaxnreg, wgmma
#include "sm90_config.cuh"         // shapes, thread roles, named barriers, the shared-memory map and swizzle
#include "sm90_load_pipeline.cuh"  // the producer warpgroup: Q, then K/V tiles by bulk copy or cp.async
#include "sm90_consumer.cuh"       // the consumer warpgroups' mainloop: S = QK^T, softmax, O += PV, ping-pong
#include "sm90_epilogue.cuh"       // O / l to out, and the LSE


namespace pw_prefill_sm90 {

using namespace pw_ptx;
using pw_tile::TileGeometry;

// ------------------------------------------------------------------------------------------------ the kernel
#ifdef PW_SM90_DEVICE_CODE
// A consumer warpgroup's role: its mainloop over the tile's KV tiles, then its epilogue.
template <int kCtaQ, int kWG>
__device__ __forceinline__ void consumer(const Params& p, const Smem<kCtaQ, kWG>& sm, const CUtensorMap* map_o,
                                         bool o_bulk) {
  const TileGeometry t = pw_tile::tile_geometry<kCtaQ, kKvTile>(p, blockIdx.x);
  const ConsumerThread th(p);
  float o[kORegs];                    // O: this thread's fragment of the warpgroup's 64 x 256 fp32 accumulator
  pw_softmax::OnlineSoftmax softmax;  // rows g and g + 8: running max and row sums
  consumer_mainloop<kCtaQ, kWG>(p, sm, t, th, o, softmax);
  consumer_epilogue<kCtaQ, kWG>(p, sm, t, th, o, softmax, map_o, o_bulk);
  trace_consumer_exit(th.cw);  // a -DPW_SM90_WAIT_TRACE=1 build only
}
#endif  // PW_SM90_DEVICE_CODE

// kTma: K/V tiles by bulk tensor copy through map_k / map_v (page_size 8, 16, 32 or a multiple of 64), else by
// cp.async (the maps are then unused). q_bulk / o_bulk: a consumer warpgroup whose 64 rows are all the tile's
// reads its Q rows through map_q (the producer) / writes its output rows through map_o (the epilogue), else (the
// map unused) row by row.
template <int kCtaQ, int kWG, bool kTma>
__global__ void __launch_bounds__(Cfg<kCtaQ, kWG>::kThreads, Cfg<kCtaQ, kWG>::kMinBlocks)
    pw_prefill_hd256_sm90_kernel(const __grid_constant__ Params p, const __grid_constant__ CUtensorMap map_k,
                                 const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_q,
                                 const __grid_constant__ CUtensorMap map_o, int q_bulk, int o_bulk) {
#ifdef PW_SM90_DEVICE_CODE
  using C = Cfg<kCtaQ, kWG>;
  // Static shared memory exists only in the sm_90a build: the host launcher checks for it (an empty kernel
  // from a compute_90 build without the arch-specific features has none).
  __shared__ __align__(8) unsigned long long bars[C::kNumBarriers];
  extern __shared__ __align__(16) unsigned char smem[];  // base rounded up to 1024 B at run time

  // Setup: the tile (the grid's x is a capacity; a tile past its request's rows has nothing to do), the
  // shared-memory map, the pipeline's mbarriers.
  if (static_cast<int>(blockIdx.x) >= p.plan_scalars[2]) return;
  if (pw_tile::tile_geometry<kCtaQ, kKvTile>(p, blockIdx.x).rows_valid <= 0) return;  // uniform across the CTA
  const Smem<kCtaQ, kWG> sm(smem, bars);
  if (threadIdx.x == 0) {
    trace_cta_entry();  // a -DPW_SM90_WAIT_TRACE=1 build only
    init_pipeline_barriers<kCtaQ, kWG, kTma>(sm);
  }
  __syncthreads();

  // Role dispatch. Each role recomputes the tile geometry after setmaxnreg, so that few values are live across it.
  if (threadIdx.x < kProducerThreads) {  // warpgroup 0: the producer
    if constexpr (C::kSetMaxNReg) setmaxnreg_dec<C::kProducerRegs>();
    if constexpr (kTma) {
      producer_tma<kCtaQ, kWG>(p, sm, &map_k, &map_v, &map_q, q_bulk != 0);
    } else {
      producer_cp_async<kCtaQ, kWG>(p, sm, &map_q, q_bulk != 0);
    }
  } else {  // warpgroups 1 .. kWG: the consumers (mainloop, then epilogue)
    if constexpr (C::kSetMaxNReg) setmaxnreg_inc<C::kConsumerRegs>();
    consumer<kCtaQ, kWG>(p, sm, &map_o, o_bulk != 0);
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
  // The static barriers come on top of the dynamic bytes.
  constexpr int kStaticBytesBound = 128;
  static_assert(sizeof(unsigned long long) * Cfg<kCtaQ, kWG>::kNumBarriers <= kStaticBytesBound, "barriers");
  if (optin < bytes + kStaticBytesBound) return PW_PREFILL_ERR_SMEM_UNAVAILABLE;
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
static int start(const Params& p, const CUtensorMap (&maps)[2], const CUtensorMap& map_q, bool q_bulk,
                 const CUtensorMap& map_o, bool o_bulk, int grid_tiles, int device, cudaStream_t stream) {
  using C = Cfg<kCtaQ, kWG>;
  const int rc = ensure_smem<kCtaQ, kWG, kTma>(device);
  if (rc != 0) return rc;
  const dim3 grid(static_cast<unsigned>(grid_tiles), static_cast<unsigned>(p.num_kv_heads), 1);
  pw_prefill_hd256_sm90_kernel<kCtaQ, kWG, kTma>
      <<<grid, C::kThreads, C::kSmemBytes, stream>>>(p, maps[0], maps[1], map_q, map_o, q_bulk ? 1 : 0, o_bulk ? 1 : 0);
  return static_cast<int>(cudaGetLastError());
}

// The tensor maps a launch needs depend only on a few values of the call (its key), and a serving loop launches
// on the same pool, layer and output buffer every step: the last kEntries encodings per key type are kept per
// host thread (one cache per key type, shared by every tile's launcher), replaced in turn. On a miss,
// Key::encode(key, maps) fills the new entry and says whether its maps are usable; the entry's answer is returned
// with a copy of its maps.
template <typename Key, int kMaps>
static bool cached_maps(const Key& key, CUtensorMap (&maps)[kMaps]) {
  constexpr int kEntries = 4;
  struct Entry {
    bool used;
    Key key;
    bool ok;
    CUtensorMap maps[kMaps];
  };
  thread_local Entry cache[kEntries] = {};
  thread_local int next = 0;
  for (const Entry& e : cache) {
    if (e.used && e.key == key) {
      memcpy(maps, e.maps, sizeof(e.maps));
      return e.ok;
    }
  }
  Entry& e = cache[next];
  next = (next + 1) % kEntries;
  e.ok = Key::encode(key, e.maps);
  e.key = key;
  e.used = true;
  memcpy(maps, e.maps, sizeof(e.maps));
  return e.ok;
}

// What the K/V maps depend on (encode_kv_maps' arguments).
struct KvMapKey {
  const void* pool;
  long long k_offset, v_offset, page_stride;
  int page_size, num_kv_heads;
  bool operator==(const KvMapKey& o) const {
    return pool == o.pool && k_offset == o.k_offset && v_offset == o.v_offset && page_stride == o.page_stride &&
           page_size == o.page_size && num_kv_heads == o.num_kv_heads;
  }
  static bool encode(const KvMapKey& k, CUtensorMap (&maps)[2]) {
    return encode_kv_maps(k.pool, k.k_offset, k.v_offset, k.page_stride, k.page_size, k.num_kv_heads, maps);
  }
};

// A tensor map for bulk copies of a consumer warpgroup's 64 rows of q or out: `rows` seen as the 3-D tensor {head
// dim 256, q head, token} (innermost first), strides 512 B and num_qo_heads * 512 B; box {64, group, 64 / group},
// 128-byte swizzle (the layout of Q and of the staged output in shared memory). The token extent is the int32
// limit: a box is read or written only when all of its rows are the tile's. Returns false (rows are copied one by
// one) when group does not divide 64, `rows` is not 16-byte aligned, or the driver cannot encode the map.
static bool encode_rows_map(const void* rows, int num_qo_heads, int group, CUtensorMapL2promotion promotion,
                            CUtensorMap* map) {
  if (group < 1 || kWarpgroupRows % group != 0 || reinterpret_cast<uintptr_t>(rows) % 16 != 0) return false;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t elem = sizeof(__nv_bfloat16);
  const cuuint64_t dims[3] = {kPwPrefillHeadDim, static_cast<cuuint64_t>(num_qo_heads), 0x7fffffffull};
  const cuuint64_t strides[2] = {kPwPrefillHeadDim * elem,
                                 static_cast<cuuint64_t>(num_qo_heads) * kPwPrefillHeadDim * elem};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(kBlockCols), static_cast<cuuint32_t>(group),
                             static_cast<cuuint32_t>(kWarpgroupRows / group)};
  const cuuint32_t unit[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(rows), dims, strides, box, unit,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// What the map of q (kOut false: read, with 256-byte L2 promotion like the K/V maps) or of out (kOut true: written)
// depends on (encode_rows_map's arguments). The two are separate key types, so each has its own cache.
template <bool kOut>
struct RowsMapKey {
  const void* rows;
  int num_qo_heads, group;
  bool operator==(const RowsMapKey& o) const {
    return rows == o.rows && num_qo_heads == o.num_qo_heads && group == o.group;
  }
  static bool encode(const RowsMapKey& k, CUtensorMap (&map)[1]) {
    return encode_rows_map(k.rows, k.num_qo_heads, k.group,
                           kOut ? CU_TENSOR_MAP_L2_PROMOTION_NONE : CU_TENSOR_MAP_L2_PROMOTION_L2_256B, &map[0]);
  }
};

// The device/binary check (both instantiations of a tile come from one build), the empty-grid return, then the
// K/V copy path: bulk copies when the maps encode, else cp.async (the maps are then passed unused); and the
// Q and output paths: bulk copies of whole warpgroups' rows when q's / out's map encodes.
template <int kCtaQ, int kWG>
static int launch(const Params& p, int grid_tiles, int device, cudaStream_t stream) {
  const int rc = check_arch<kCtaQ, kWG>(device);
  if (rc != 0) return rc;
  if (grid_tiles == 0) return PW_PREFILL_OK;  // nothing to launch
  CUtensorMap map_q[1], map_o[1];
  const bool q_bulk = cached_maps(RowsMapKey<false>{p.q, p.num_qo_heads, p.group}, map_q);
  if (!q_bulk) memset(map_q, 0, sizeof(map_q));
  const bool o_bulk = cached_maps(RowsMapKey<true>{p.out, p.num_qo_heads, p.group}, map_o);
  if (!o_bulk) memset(map_o, 0, sizeof(map_o));
  CUtensorMap maps[2];
  if (cached_maps(KvMapKey{p.pool, p.k_offset, p.v_offset, p.page_stride, p.page_size, p.num_kv_heads}, maps)) {
    return start<kCtaQ, kWG, true>(p, maps, map_q[0], q_bulk, map_o[0], o_bulk, grid_tiles, device, stream);
  }
  memset(maps, 0, sizeof(maps));
  return start<kCtaQ, kWG, false>(p, maps, map_q[0], q_bulk, map_o[0], o_bulk, grid_tiles, device, stream);
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
      return grid_tiles == 0 ? PW_PREFILL_OK : pw_decode_hd256_launch(p, grid_tiles, a->max_tile_splits, s);
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

// The wait trace of a -DPW_SM90_WAIT_TRACE=1 build (sm90_wait_trace.cuh): copies min(words, the buffer's) uint32
// into host memory `dst`, then zeroes the buffer. Returns the words copied, -1 in a build without the trace, or
// -(CUDA error). Synchronises with the device.
extern "C" long long pw_prefill_sm90_wait_trace(uint32_t* dst, long long words) {
#if PW_SM90_WAIT_TRACE
  return pw_copy_trace_and_zero(pw_prefill_sm90::g_wait_trace, dst, words);
#else
  (void)dst;
  (void)words;
  return -1;
#endif
}

// The trace's layout (sm90_wait_trace.cuh): {rows (three per CTA traced), main-loop iterations traced, uint32 per
// row}.
extern "C" void pw_prefill_sm90_wait_trace_layout(int* out) {
  out[0] = pw_prefill_sm90::kTraceRows;
  out[1] = pw_prefill_sm90::kTraceIters;
  out[2] = pw_prefill_sm90::kTraceSlots;
}
