// pagedwindow: a measurement build of the Hopper prefill kernel (-DPW_SM90_WAIT_TRACE=1; off by default, when
// WaitTrace is the plain mbarrier wait and ProducerTrace records nothing). Thread 0 of every consumer warpgroup
// records, in SM clock cycles, how long each of its waits for data took and how long each main-loop iteration
// took; lane 0 of the bulk-copy producer's K and V warps records when each tile's copies were issued (the cp.async
// producer, whose warps copy both, records none). The host reads the buffer with pw_prefill_sm90_wait_trace
// (prefill_hd256_sm90.cu; benchmarks/wait_trace.py).
//
// Three rows of kTraceSlots uint32 per CTA c (blockIdx.y * gridDim.x + blockIdx.x < kTraceCtas): row 3c + cw for
// consumer warpgroup cw, row 3c + 2 for the producer. I = kTraceIters main-loop iterations are traced.
//   consumer: [0] the wait for Q, [1] the wait for K(0), [kTraceSlotK + j] the wait for K(j+1) in iteration j,
//     [kTraceSlotIter + j] the cycles of iteration j (from its first wait to the next iteration's),
//     [kTraceSlotV + j] the wait for V(j) in iteration j, [kTraceSlotKEnd + j] the clock (low 32 bits) at which
//     the wait for K(j+1) ended, [kTraceSlotTiles] the CTA's KV tiles, [kTraceSlotTotal] the cycles from Q's wait
//     to the loop's end, [kTraceSlotQClock] the clock at Q's wait, [kTraceSlotExit] the clock at the end of the
//     epilogue, [kTraceSlotExitNs] (two words, low first) the global timer there in ns, [kTraceSlotLastV] the wait
//     for V(n-1) after the loop, [kTraceSlotPvDone] the clock when PV(n-1) has completed, [kTraceSlotStaged] the
//     clock when the epilogue has staged O in shared memory (before its global stores);
//   producer: [t] the clock at which K(t)'s copies were issued (its buffer free), [kTraceSlotIssueV + t] V(t)'s,
//     t < I + 2; [kTraceSlotSm] the SM the CTA ran on, [kTraceSlotEntry] the clock when the CTA started (before
//     its barriers are set up), [kTraceSlotEntryNs] (two words) the global timer then.
// Clocks are an SM's own (comparable within one SM); the global timer is the device's (comparable across SMs).
#pragma once

#include <stdint.h>

#include "sm90_ptx.cuh"       // mbar_wait, PW_SM90_DEVICE_CODE
#include "trace_readout.cuh"  // pw_copy_trace_and_zero: the host reads the buffer out

#ifndef PW_SM90_WAIT_TRACE
#define PW_SM90_WAIT_TRACE 0
#endif

namespace pw_prefill_sm90 {

constexpr int kTraceCtas = 4096;  // CTAs traced: those with a linear block id below this
constexpr int kTraceIters = 32;   // main-loop iterations traced per CTA
constexpr int kTraceSlotQ = 0, kTraceSlotK0 = 1, kTraceSlotK = 2;
constexpr int kTraceSlotIter = kTraceSlotK + kTraceIters, kTraceSlotV = kTraceSlotIter + kTraceIters;
constexpr int kTraceSlotKEnd = kTraceSlotV + kTraceIters, kTraceSlotTiles = kTraceSlotKEnd + kTraceIters;
constexpr int kTraceSlotTotal = kTraceSlotTiles + 1, kTraceSlotQClock = kTraceSlotTotal + 1;
constexpr int kTraceSlotExit = kTraceSlotQClock + 1, kTraceSlotExitNs = kTraceSlotExit + 1;
constexpr int kTraceSlotLastV = kTraceSlotExitNs + 2, kTraceSlotPvDone = kTraceSlotLastV + 1;
constexpr int kTraceSlotStaged = kTraceSlotPvDone + 1, kTraceSlots = kTraceSlotStaged + 1;
constexpr int kTraceSlotIssueV = kTraceIters + 2;  // producer row: V's issue clocks after K's, then the CTA's start
constexpr int kTraceSlotSm = kTraceSlotIssueV + kTraceIters + 2, kTraceSlotEntry = kTraceSlotSm + 1;
constexpr int kTraceSlotEntryNs = kTraceSlotEntry + 1;
static_assert(kTraceSlotEntryNs + 2 <= kTraceSlots, "the producer row's slots fit a row");
constexpr int kTraceRows = 3 * kTraceCtas;
constexpr int kTraceWords = kTraceRows * kTraceSlots;  // the buffer: 6.5 MB

#if PW_SM90_WAIT_TRACE
__device__ uint32_t g_wait_trace[kTraceWords];  // declared in every pass: the host copies it out by symbol
#endif

#if defined(PW_SM90_DEVICE_CODE) && PW_SM90_WAIT_TRACE
__device__ __forceinline__ uint32_t* trace_row(int row_in_cta) {
  const int cta = static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x);
  return cta < kTraceCtas ? g_wait_trace + (3 * cta + row_in_cta) * kTraceSlots : nullptr;
}

__device__ __forceinline__ void record_clock_and_time(uint32_t* row, int slot_clock, int slot_ns) {
  const long long c = clock64();
  const unsigned long long ns = pw_ptx::global_timer_ns();
  row[slot_clock] = static_cast<uint32_t>(c);
  row[slot_ns] = static_cast<uint32_t>(ns);
  row[slot_ns + 1] = static_cast<uint32_t>(ns >> 32);
}

// Thread 0, first thing in the CTA: its SM and its start.
__device__ __forceinline__ void trace_cta_entry() {
  uint32_t* const row = trace_row(2);
  if (row == nullptr) return;
  row[kTraceSlotSm] = pw_ptx::sm_id();
  record_clock_and_time(row, kTraceSlotEntry, kTraceSlotEntryNs);
}

// Thread 0 of consumer warpgroup cw: the clock (low 32 bits) into `slot` of its row.
__device__ __forceinline__ void trace_consumer_clock(int cw, int slot) {
  if ((threadIdx.x & 127) != 0) return;
  uint32_t* const row = trace_row(cw);
  if (row != nullptr) row[slot] = static_cast<uint32_t>(clock64());
}

// Thread 0 of consumer warpgroup cw, after its epilogue.
__device__ __forceinline__ void trace_consumer_exit(int cw) {
  if ((threadIdx.x & 127) != 0) return;
  uint32_t* const row = trace_row(cw);
  if (row != nullptr) record_clock_and_time(row, kTraceSlotExit, kTraceSlotExitNs);
}

struct WaitTrace {
  uint32_t* row;    // this thread's row, or null: it does not record
  long long start;  // clock64 at the wait for Q
  long long iter;   // clock64 at the current iteration's first wait
  __device__ __forceinline__ explicit WaitTrace(int cw) : start(0), iter(0) {
    row = (threadIdx.x & 127) == 0 ? trace_row(cw) : nullptr;
  }
  // The mbarrier wait, its cycles recorded in `slot`.
  __device__ __forceinline__ void wait(int slot, uint32_t bar, uint32_t parity) {
    const long long t0 = clock64();
    if (slot == kTraceSlotQ) {
      start = t0;
      if (row != nullptr) row[kTraceSlotQClock] = static_cast<uint32_t>(t0);
    }
    pw_ptx::mbar_wait<false>(bar, parity);
    if (row != nullptr) row[slot] = static_cast<uint32_t>(clock64() - t0);
  }
  // The wait for K(j+1) in iteration j: its cycles and the clock at its end.
  __device__ __forceinline__ void wait_k(int j, uint32_t bar, uint32_t parity) {
    const long long t0 = clock64();
    pw_ptx::mbar_wait<false>(bar, parity);
    const long long t1 = clock64();
    if (row != nullptr && j < kTraceIters) {
      row[kTraceSlotK + j] = static_cast<uint32_t>(t1 - t0);
      row[kTraceSlotKEnd + j] = static_cast<uint32_t>(t1);
    }
  }
  __device__ __forceinline__ void wait_v(int j, uint32_t bar, uint32_t parity) {
    const long long t0 = clock64();
    pw_ptx::mbar_wait<false>(bar, parity);
    if (row != nullptr && j < kTraceIters) row[kTraceSlotV + j] = static_cast<uint32_t>(clock64() - t0);
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

struct ProducerTrace {
  uint32_t* row;  // lane 0's producer row, or null
  __device__ __forceinline__ explicit ProducerTrace(int lane) { row = lane == 0 ? trace_row(2) : nullptr; }
  // K(t)'s (or V(t)'s) buffer is free and its copies go out now.
  __device__ __forceinline__ void issued(bool is_k, int t) {
    if (row != nullptr && t < kTraceIters + 2)
      row[(is_k ? 0 : kTraceSlotIssueV) + t] = static_cast<uint32_t>(clock64());
  }
};
#elif defined(PW_SM90_DEVICE_CODE)
__device__ __forceinline__ void trace_cta_entry() {}
__device__ __forceinline__ void trace_consumer_clock(int, int) {}
__device__ __forceinline__ void trace_consumer_exit(int) {}
struct WaitTrace {
  __device__ __forceinline__ explicit WaitTrace(int) {}
  __device__ __forceinline__ void wait(int, uint32_t bar, uint32_t parity) { pw_ptx::mbar_wait<false>(bar, parity); }
  __device__ __forceinline__ void wait_k(int, uint32_t bar, uint32_t parity) { pw_ptx::mbar_wait<false>(bar, parity); }
  __device__ __forceinline__ void wait_v(int, uint32_t bar, uint32_t parity) { pw_ptx::mbar_wait<false>(bar, parity); }
  __device__ __forceinline__ void iteration(int) {}
  __device__ __forceinline__ void finish(int, int) {}
};
struct ProducerTrace {
  __device__ __forceinline__ explicit ProducerTrace(int) {}
  __device__ __forceinline__ void issued(bool, int) {}
};
#endif

}  // namespace pw_prefill_sm90
