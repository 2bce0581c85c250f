// Host cost of one cudaLaunchKernel by kernel-parameter size: N launches enqueued behind a spinning kernel, so the
// wall clock per launch is the host's alone. Usage on a GPU machine:
//   nvcc -O2 -arch=sm_90a -o /tmp/launch_param_probe benchmarks/launch_param_probe.cu && /tmp/launch_param_probe
#include <cstdio>
#include <chrono>
#include <cuda_runtime.h>
template <int N> struct P { float f[N]; int x; };
template <int N> __global__ void k(P<N> p) { if (threadIdx.x == 1000) printf("%f", p.f[N - 1]); }
__global__ void spin(long long c) { long long t0 = clock64(); while (clock64() - t0 < c) {} }
template <int N> double bench(cudaStream_t s) {
  P<N> p{}; const int n = 500;
  for (int i = 0; i < 100; ++i) k<N><<<132, 128, 0, s>>>(p);
  cudaStreamSynchronize(s);
  double best = 1e9;
  for (int r = 0; r < 7; ++r) {
    spin<<<1, 1, 0, s>>>(60000000LL);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) k<N><<<132, 128, 0, s>>>(p);
    auto t1 = std::chrono::steady_clock::now();
    cudaStreamSynchronize(s);
    double us = std::chrono::duration<double, std::micro>(t1 - t0).count() / n;
    if (us < best) best = us;
  }
  return best;
}
int main() {
  cudaStream_t s; cudaStreamCreate(&s);
  printf("| kernel params (bytes) | host us per launch |\n|---|---|\n");
  printf("| %zu | %.2f |\n", sizeof(P<1>), bench<1>(s));
  printf("| %zu | %.2f |\n", sizeof(P<32>), bench<32>(s));
  printf("| %zu | %.2f |\n", sizeof(P<64>), bench<64>(s));
  printf("| %zu | %.2f |\n", sizeof(P<128>), bench<128>(s));
  printf("| %zu | %.2f |\n", sizeof(P<256>), bench<256>(s));
  printf("| %zu | %.2f |\n", sizeof(P<1024>), bench<1024>(s));
  return 0;
}
