// pagedwindow: PTX helpers the kernels share (prefill_hd256.cu, prefill_hd256_sm90.cu, decode_hd256.cu,
// prepare_qkv.cu). The sm_90-only ones (transaction counts, bulk copies, wgmma, ...) are in sm90_ptx.cuh.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace pw_ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_bytes 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Close the copies issued since the last commit into a group; wait until at most kPending groups are in flight.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// Wait for every copy this thread issued, committed or not (those tracked by an mbarrier included).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// The device's global timer in ns (comparable across SMs), and the SM this thread runs on: for the measurement
// builds (sm90_wait_trace.cuh, decode_trace.cuh).
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}

// mbarriers (sm_80 and later; the sm_90 operations — transaction counts, the watchdog wait, the init fence — are in
// sm90_ptx.cuh).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// One probe: has the phase with parity `parity` completed? (acquire, CTA scope) mbarrier.test_wait answers at
// once (sm_80); kSuspend: mbarrier.try_wait, which may first suspend the thread a while (sm_90).
template <bool kSuspend>
__device__ __forceinline__ bool mbar_probe(uint32_t bar, uint32_t parity) {
  uint32_t done;
  if constexpr (kSuspend) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } else {
    asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  }
  return done != 0;
}
// Arrive on the mbarrier once all of this thread's prior cp.async copies have landed (counts as one of the
// barrier's expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// atomicAdd with acquire-release semantics at GPU scope: the calling thread's earlier writes, and those ordered
// before it by a barrier it took part in (bar.warp.sync / bar.sync), are visible to whoever acquires the new
// value; writes the returned value's earlier releasers made are visible to this thread's later reads. Returns
// the old value. (Lighter than __threadfence(), a sequentially consistent fence, around a relaxed atomic.)
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx(-inf) == +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats -> bf16x2 (round to nearest even); `lo` goes to the low 16 bits (the lower column index).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// ldmatrix (x4, and transposed) and mma.sync m16n8k16: the mma.sync kernels' (prefill_hd256.cu, decode_hd256.cu)
// operand loads and product.
__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// D = A * B + D, m16n8k16, A row-major bf16, B col-major bf16, fp32 accumulate.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Write a warp's 16 x 256 fp32 mma.sync m16n8k16 accumulator (o[n]: columns 8n .. 8n + 7; this lane holds rows
// g = lane / 4 and g + 8, columns 2 c4 and 2 c4 + 1 with c4 = lane % 4), rows scaled by inv0 and inv1, as bf16
// into shared-memory rows row0 .. row0 + 15 of 512 bytes from `base` (row r's 16-byte chunk c at chunk c ^ (r & 7):
// the kernels' swizzle; row0 % 8 == 0, so row row0 + g swizzles by g).
constexpr int kAccRowBytes = 512;  // one bf16 row of head_dim 256
__device__ __forceinline__ void store_acc_rows_bf16(uint32_t base, int row0, const float (&o)[32][4], float inv0,
                                                    float inv1, int g, int c4) {
  const int row = row0 + g;
#pragma unroll
  for (int n = 0; n < 32; ++n) {
    const uint32_t a = base + row * kAccRowBytes + ((n ^ g) << 4) + c4 * 4;
    st_shared_b32(a, pack_bf16x2(o[n][0] * inv0, o[n][1] * inv0));
    st_shared_b32(a + 8 * kAccRowBytes, pack_bf16x2(o[n][2] * inv1, o[n][3] * inv1));
  }
}

}  // namespace pw_ptx
