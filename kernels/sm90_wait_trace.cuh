// pagedwindow: a measurement build of the Hopper prefill kernel (-DPW_SM90_WAIT_TRACE=1; off by default, when
// WaitTrace is the plain mbarrier wait and records nothing). Thread 0 of every consumer warpgroup records, in
// SM clock cycles, how long each of its mbarrier waits for data took and how long each main-loop iteration took,
// into a device buffer that the host reads with pw_prefill_sm90_wait_trace (prefill_hd256_sm90.cu).
//
// Row of CTA c (blockIdx.y * gridDim.x + blockIdx.x < kTraceCtas) and consumer warpgroup cw: index c * 2 + cw,
// kTraceSlots uint32 each:
//   [0] the wait for Q, [1] the wait for K(0),
//   [2 + j] the wait for K(j+1) in main-loop iteration j (j < kTraceIters),
//   [2 + kTraceIters + j] the cycles of iteration j, from its first wait to the next iteration's,
//   [2 + 2 kTraceIters] the CTA's KV tile count, [3 + 2 kTraceIters] the cycles from Q's wait to the loop's end.
#pragma once

#include <stdint.h>

#include "sm90_ptx.cuh"  // mbar_wait, PW_SM90_DEVICE_CODE

#ifndef PW_SM90_WAIT_TRACE
#define PW_SM90_WAIT_TRACE 0
#endif

namespace pw_prefill_sm90 {

constexpr int kTraceCtas = 8192;  // CTAs traced: those with a linear block id below this
constexpr int kTraceIters = 32;   // main-loop iterations traced per CTA
constexpr int kTraceSlotQ = 0, kTraceSlotK0 = 1, kTraceSlotK = 2, kTraceSlotIter = 2 + kTraceIters;
constexpr int kTraceSlotTiles = 2 + 2 * kTraceIters, kTraceSlotTotal = 3 + 2 * kTraceIters;
constexpr int kTraceSlots = 4 + 2 * kTraceIters;
constexpr int kTraceWords = kTraceCtas * 2 * kTraceSlots;  // the buffer: 2.1 MB

#if PW_SM90_WAIT_TRACE
__device__ uint32_t g_wait_trace[kTraceWords];  // declared in every pass: the host copies it out by symbol
#endif

#if defined(PW_SM90_DEVICE_CODE) && PW_SM90_WAIT_TRACE

struct WaitTrace {
  uint32_t* row;    // this thread's row, or null: it does not record
  long long start;  // clock64 at the wait for Q
  long long iter;   // clock64 at the current iteration's first wait
  __device__ __forceinline__ explicit WaitTrace(int cw) : start(0), iter(0) {
    const int cta = static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x);
    row = ((threadIdx.x & 127) == 0 && cta < kTraceCtas) ? g_wait_trace + (cta * 2 + cw) * kTraceSlots : nullptr;
  }
  // The mbarrier wait, its cycles recorded in `slot` (slots past the row are dropped).
  __device__ __forceinline__ void wait(int slot, uint32_t bar, uint32_t parity) {
    const long long t0 = clock64();
    if (slot == kTraceSlotQ) start = t0;
    pw_ptx::mbar_wait<false>(bar, parity);
    if (row != nullptr && slot < kTraceSlotIter) row[slot] = static_cast<uint32_t>(clock64() - t0);
  }
  // Call at the top of main-loop iteration j: closes iteration j - 1.
  __device__ __forceinline__ void iteration(int j) {
    const long long t = clock64();
    if (row != nullptr && j >= 1 && j <= kTraceIters) row[kTraceSlotIter + j - 1] = static_cast<uint32_t>(t - iter);
    iter = t;
  }
  __device__ __forceinline__ void finish(int j, int n_tiles) {
    iteration(j);
    if (row != nullptr) {
      row[kTraceSlotTiles] = static_cast<uint32_t>(n_tiles);
      row[kTraceSlotTotal] = static_cast<uint32_t>(clock64() - start);
    }
  }
};
#elif defined(PW_SM90_DEVICE_CODE)
struct WaitTrace {
  __device__ __forceinline__ explicit WaitTrace(int) {}
  __device__ __forceinline__ void wait(int, uint32_t bar, uint32_t parity) { pw_ptx::mbar_wait<false>(bar, parity); }
  __device__ __forceinline__ void iteration(int) {}
  __device__ __forceinline__ void finish(int, int) {}
};
#endif

}  // namespace pw_prefill_sm90
