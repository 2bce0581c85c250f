// pagedwindow: the sm_90 PTX the Hopper prefill kernel (prefill_hd256_sm90.cu) and the prep kernel
// (prepare_qkv.cu) use, one thin wrapper per instruction: mbarrier transaction counts and waits (with the wait's
// watchdog), bulk and bulk tensor copies that complete on an mbarrier, stmatrix, the async-proxy fence, named
// barriers, setmaxnreg, and wgmma (fence / commit / wait, shared-memory descriptors, the three instruction shapes
// the kernel issues). The PTX sm_80 has too (cp.async, the plain mbarrier operations, ldmatrix, mma.sync, bf16
// packing, shared loads and stores) is in ptx_common.cuh.
//
// Everything here exists only in the sm_90a device pass (PW_SM90_DEVICE_CODE); the sm_80 / sm_89 builds and
// the host pass see none of it.
#pragma once

#include <stdint.h>

#include <cuda.h>  // CUtensorMap

#include "ptx_common.cuh"  // smem_addr, cp.async, and the mbarrier operations sm_80 has

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PW_SM90_DEVICE_CODE 1
#endif

// Device-side watchdog on every mbarrier wait (1 = on, 0 = off): see mbar_wait.
#ifndef PW_SM90_WATCHDOG
#define PW_SM90_WATCHDOG 1
#endif

#ifdef PW_SM90_DEVICE_CODE
namespace pw_ptx {  // continues ptx_common.cuh's namespace

// A wait longer than this many ticks of globaltimer_hi (2^32 ns = 4.29 s each; 17-21 s) is a hung pipeline.
constexpr uint32_t kWatchdogTicks = 4;

// ----------------------------------------------------------------------------------------------- mbarriers
// Make the barriers' initialisation visible to the other threads (and the async proxy) before any use.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrive once on the mbarrier and raise its expected transaction count by `bytes`.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Raise the mbarrier's expected transaction count by `bytes` without arriving (the phase still needs its
// arrivals; post this before this thread's own arrival so that the phase cannot complete without the bytes).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Upper 32 bits of the global nanosecond timer (one tick = 2^32 ns = 4.29 s).
__device__ __forceinline__ uint32_t globaltimer_hi() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%globaltimer_hi;\n" : "=r"(t));
  return t;
}
// Wait until the phase with parity `parity` has completed. With PW_SM90_WATCHDOG (default on), a wait that
// spans more than kWatchdogTicks ticks of globaltimer_hi aborts the grid, so a pipeline bug becomes a launch
// error instead of a hung GPU; the timer is read only on the slow path. kTrap: the producer traps; the
// consumers store to address 0 instead (the grid dies with an illegal-address error just the same), because a
// trap inside their wgmma pipeline makes ptxas serialise the wgmmas and spill.
template <bool kTrap>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_probe<true>(bar, parity)) return;
#if PW_SM90_WATCHDOG
  const uint32_t t0 = globaltimer_hi();
  while (!mbar_probe<true>(bar, parity)) {
    if (globaltimer_hi() - t0 > kWatchdogTicks) {
      if constexpr (kTrap) {
        __trap();
      } else {
        asm volatile("st.global.u32 [%0], %1;\n" ::"l"(0ull), "r"(0u) : "memory");
        return;
      }
    }
  }
#else
  while (!mbar_probe<true>(bar, parity)) {
  }
#endif
}


// ------------------------------------------------------------------------------ copies that land on an mbarrier

// Bulk copy (no tensor map) of `bytes` contiguous bytes into shared memory, completing `bytes` of the mbarrier's
// transaction count. Both addresses 16-byte aligned, `bytes` a multiple of 16.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Bulk tensor copy (TMA) of one box of the 4-D pool view {head dim, kv head, slot, page} into shared memory,
// completing `bytes` of the mbarrier's transaction count.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// Bulk tensor copy (TMA) of one box of the 3-D view {head dim, q head, token} of q into shared memory, its bytes
// completing on the mbarrier's transaction count.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Bulk tensor copy (TMA) of one box from shared memory to the 3-D view {head dim, q head, token} of `out`, in this
// thread's bulk async-group.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
// Close this thread's bulk async-group, then wait until all of its groups have read their shared-memory sources
// (their global writes may still be in flight; the shared memory may then be reused or freed).
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_group_read_all() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// Store four 8 x 8 matrices of b16 to shared memory (stmatrix .x4): lanes 8m .. 8m + 7 give the addresses of
// matrix m's rows 0 .. 7 (16 bytes each); r_m is this lane's fragment of matrix m, row lane / 4, columns
// 2 (lane % 4) and + 1 (the layout of an mma / wgmma accumulator's 8 x 8 pieces).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// Make data written through the generic proxy (cp.async, st.shared) visible to the async proxy (wgmma operand
// reads, bulk copies).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }


// ---------------------------------------------------------------------- named barriers and register budgets
// bar.sync / bar.arrive on barrier `id` (0 is __syncthreads) expecting `threads` arrivals (a multiple of 32).
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}


// Move this warpgroup's register budget down / up to kRegs per thread (all four warps execute it).
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}


// ------------------------------------------------------------------------------------------------------ wgmma
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>  // wait until at most kPending of this thread's wgmma groups are still in flight
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Pin an accumulator register at this point of the program (no compiler motion of its reads/writes across).
__device__ __forceinline__ void reg_fence(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void reg_fence_u32(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }

// Shared-memory matrix descriptor (sm_90 wgmma):
//   bits  0..13 start address >> 4      bits 16..29 leading-dimension byte offset >> 4
//   bits 32..45 stride-dimension byte offset >> 4      bits 49..51 base offset (0: atoms 1024-B aligned)
//   bits 62..63 swizzle mode (1 = 128-byte swizzle)
// Low word = start | LBO << 16, high word = SBO | mode << 30. SBO = 1024 B (next 8-row / 8-key group) for
// every operand here; LBO = 16 B (ignored) for K-major, 8192 B (next 64-column block) for MN-major V.
__device__ __forceinline__ uint32_t desc_lo(uint32_t smem_byte_addr, uint32_t lbo_bytes) {
  return ((smem_byte_addr & 0x3FFFFu) >> 4) | ((lbo_bytes >> 4) << 16);
}
constexpr uint32_t kDescLboUnused = 16;      // LBO of a K-major swizzled operand (ignored by the hardware)
constexpr uint32_t kDescStrideBytes = 1024;  // SBO: the next 8-row (8-key) group, one 8 x 128 B swizzle atom
constexpr uint32_t kDescSwizzle128B = 1;     // layout type, bits 62..63
constexpr uint32_t kDescHi = (kDescStrideBytes >> 4) | (kDescSwizzle128B << 30);
__device__ __forceinline__ uint64_t make_desc(uint32_t lo) {
  return (static_cast<uint64_t>(kDescHi) << 32) | static_cast<uint64_t>(lo);
}

// The wgmma wrappers' operand lists are laid out by hand, eight accumulators a line.
// clang-format off
// D(64x64, fp32) = A(64x16, smem, K-major) * B(16x64, smem, K-major) (scale-d = 0: D is write-only, so the
// old contents of d are dead for the compiler).
__device__ __forceinline__ void wgmma_m64n64k16_ss_first(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31 "
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]),
        "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]),
        "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]),
        "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
      : "l"(desc_a), "l"(desc_b), "n"(0));
}

// D(64x64, fp32) += A(64x16, smem, K-major) * B(16x64, smem, K-major).
__device__ __forceinline__ void wgmma_m64n64k16_ss_acc(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31 "
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "n"(1));
}

// D(64x256, fp32) += A(64x16, registers) * B(16x256, smem, MN-major = transposed).
__device__ __forceinline__ void wgmma_m64n256k16_rs_tb(float (&d)[128], uint32_t a0, uint32_t a1, uint32_t a2,
                                                       uint32_t a3, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "
      "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "
      "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "
      "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, "
      "%101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, "
      "%117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127 "
      "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]),
        "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),
        "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]),
        "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "n"(1));
}
// clang-format on
}  // namespace pw_ptx
#endif  // PW_SM90_DEVICE_CODE
