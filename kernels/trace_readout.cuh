// pagedwindow: how a measurement build's host side reads its trace out (sm90_wait_trace.cuh's, decode_trace.cuh's).
// Host code, compiled only into builds that define a trace buffer.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>

// Copies min(words, N) elements of the __device__ array `buffer` into host memory `dst`, then zeroes the buffer.
// Returns the elements copied, or -(CUDA error). Synchronises with the device.
template <typename T, size_t N>
static long long pw_copy_trace_and_zero(const T (&buffer)[N], T* dst, long long words) {
  const long long n = words < static_cast<long long>(N) ? words : static_cast<long long>(N);
  cudaError_t e = cudaMemcpyFromSymbol(dst, buffer, static_cast<size_t>(n) * sizeof(T));
  if (e != cudaSuccess) return -static_cast<long long>(e);
  void* device_buffer = nullptr;
  e = cudaGetSymbolAddress(&device_buffer, buffer);
  if (e == cudaSuccess) e = cudaMemset(device_buffer, 0, sizeof(buffer));
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  return e == cudaSuccess ? n : -static_cast<long long>(e);
}
