// pagedwindow: a measurement build of the split-KV decode kernel (-DPW_DECODE_TRACE=1; off by default, when
// DecodeTrace has no state and its calls compile to nothing). Lane 0 of each CTA records when its first unit passed
// each point of its way through the launch, so that a launch's time can be laid out on the clock: when the CTAs
// started, when their first keys landed, when the last split of a tile arrived, when the merge ended. The host reads
// the buffer with pw_decode_trace (decode_hd256.cu; benchmarks/decode_trace.py).
//
// One row of kDecodeTraceSlots uint64 per CTA (blockIdx.x < kDecodeTraceCtas):
//   [kSlotEntryNs] the global timer (ns) at the CTA's start, [kSlotExitNs] at its end;
//   [kSlotSm] the SM it ran on, [kSlotUnits] the units it ran, [kSlotFirstUnit] its first unit's id + 1 (0: none),
//   [kSlotSteps] that unit's 16-key steps, [kSlotMerged] 1 if that unit merged its tile's splits;
//   SM clocks (clock64) at: [kSlotEntry] the start, [kSlotReady] the first unit's geometry known (before its Q
//   and first K/V copies are issued), [kSlotLanded] its first step's K and V (and Q) landed, [kSlotSecondStep]
//   its second step's landed (the step's code run once by then), [kSlotLoopEnd] its last step done, [kSlotStored]
//   its partial rows stored (a split) or its output rows (an unsplit tile), [kSlotArrived] its split counter's add
//   returned; in a merge, [kSlotMergeWeights] every row's split weights known, [kSlotMergeBatch] the first batch of
//   splits summed (its code run for the first time: the batches after it run the same code again),
//   [kSlotMergeRows] the rows stored, [kSlotMergeEnd] the counter reset; [kSlotExit] the end. A point the unit
//   did not pass stays 0.
// Clocks are an SM's own (comparable within a CTA); the global timer is the device's (comparable across CTAs).
#pragma once

#include <stdint.h>

#include "ptx_common.cuh"     // global_timer_ns, sm_id
#include "trace_readout.cuh"  // pw_copy_trace_and_zero: the host reads the buffer out

#ifndef PW_DECODE_TRACE
#define PW_DECODE_TRACE 0
#endif

namespace pw_decode {

constexpr int kDecodeTraceCtas = 2048;  // CTAs traced: blockIdx.x below this (the grid is at most the CTAs an SM
                                        // holds times its SMs: 528 on an H100 or H200)
enum DecodeTraceSlot : int {
  kSlotEntryNs,
  kSlotExitNs,
  kSlotSm,
  kSlotUnits,
  kSlotFirstUnit,
  kSlotSteps,
  kSlotMerged,
  kSlotEntry,
  kSlotReady,
  kSlotLanded,
  kSlotSecondStep,
  kSlotLoopEnd,
  kSlotStored,
  kSlotArrived,
  kSlotMergeWeights,
  kSlotMergeBatch,
  kSlotMergeRows,
  kSlotMergeEnd,
  kSlotExit,
  kDecodeTraceSlots
};
constexpr int kDecodeTraceWords = kDecodeTraceCtas * kDecodeTraceSlots;  // the buffer: 304 KiB

#if PW_DECODE_TRACE
__device__ unsigned long long g_decode_trace[kDecodeTraceWords];  // the host copies it out by symbol

// Lane 0 of a traced CTA records; every other thread, and every CTA past kDecodeTraceCtas, records nothing.
class DecodeTrace {
 public:
  // First thing in the CTA: its SM, its start on both clocks.
  __device__ __forceinline__ DecodeTrace()
      : row_(threadIdx.x == 0 && blockIdx.x < kDecodeTraceCtas ? g_decode_trace + blockIdx.x * kDecodeTraceSlots
                                                               : nullptr) {
    if (row_ == nullptr) return;
    row_[kSlotSm] = pw_ptx::sm_id();
    row_[kSlotEntry] = static_cast<unsigned long long>(clock64());
    row_[kSlotEntryNs] = pw_ptx::global_timer_ns();
  }
  // A unit starts: true for the CTA's first, the one the points below record.
  __device__ __forceinline__ bool unit() { return units_++ == 0; }
  // The SM clock at `slot`, or a value there, when `first`.
  __device__ __forceinline__ void clock(bool first, int slot) {
    if (row_ != nullptr && first) row_[slot] = static_cast<unsigned long long>(clock64());
  }
  __device__ __forceinline__ void value(bool first, int slot, long long v) {
    if (row_ != nullptr && first) row_[slot] = static_cast<unsigned long long>(v);
  }
  // Last thing in the CTA: the units it ran, its end on both clocks.
  __device__ __forceinline__ void exit() {
    if (row_ == nullptr) return;
    row_[kSlotUnits] = static_cast<unsigned long long>(units_);
    row_[kSlotExit] = static_cast<unsigned long long>(clock64());
    row_[kSlotExitNs] = pw_ptx::global_timer_ns();
  }

 private:
  unsigned long long* const row_;
  int units_ = 0;
};
#else
class DecodeTrace {  // the default build: no state, no code
 public:
  __device__ __forceinline__ bool unit() { return false; }
  __device__ __forceinline__ void clock(bool, int) {}
  __device__ __forceinline__ void value(bool, int, long long) {}
  __device__ __forceinline__ void exit() {}
};
#endif

}  // namespace pw_decode
