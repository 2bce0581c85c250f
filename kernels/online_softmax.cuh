// pagedwindow: the softmax all three attention kernels (prefill_hd256.cu, prefill_hd256_sm90.cu, decode_hd256.cu)
// apply to their S tiles: the boundary mask, and OnlineSoftmax (a thread's running max and row sums, the online
// step, finalize giving 1/l, and the log-sum-exp).
//
// A warp holds 16 query rows x 8 kN keys of S in the mma.m16n8k16 / wgmma accumulator layout: at(n, e) is row
// (e < 2 ? g : g + 8) of the warp's 16, key kb + 8n + 2 c4 + (e & 1), for n = 0..kN-1, e = 0..3, where g = lane / 4
// and c4 = lane % 4. `at` is any callable returning that element by reference (the kernels store S differently).
// The prefill kernels step 64 keys at a time (kN = 8), the decode kernel 16 (kN = 2). Row index 0 below is row g,
// 1 is row g + 8.
#pragma once

#include <math.h>

#include "ptx_common.cuh"

namespace pw_softmax {

constexpr float kLn2 = 0.69314718055994530942f;

// Set to -inf the logits of keys a row cannot see: key k is visible from row 0 (g) iff lo0 <= k <= qp0, from
// row 1 (g + 8) iff lo1 <= k <= qp1.
template <int kN = 8, class At>
__device__ __forceinline__ void mask_tile(At at, int kb, int c4, int lo0, int qp0, int lo1, int qp1) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = kb + 8 * n + 2 * c4 + (e & 1);
      const bool vis = (e < 2) ? (key >= lo0 && key <= qp0) : (key >= lo1 && key <= qp1);
      if (!vis) at(n, e) = -INFINITY;
    }
  }
}

// Online softmax of a thread's two rows, in the log2 domain (sl2 = sm_scale * log2(e) > 0).
struct OnlineSoftmax {
  // Row 1 before row 0, l before m: with this order the kernels compile to the SASS they had with four locals.
  float l1 = 0.f, l0 = 0.f;              // this thread's partial row sums (quad-reduced by finalize)
  float m1 = -INFINITY, m0 = -INFINITY;  // running max of the scaled (log2-domain) logits

  // One step over a tile of S. Advances m and l, leaves P = exp2(s * sl2 - m_new) in the tile (fp32, in place),
  // and returns alpha = exp2(m_old - m_new), the factor by which the row's O must be rescaled before P V is
  // added. A row with nothing visible yet keeps m = -inf and gets P = 0 and alpha = 0, not NaN.
  template <int kN = 8, class At>
  __device__ __forceinline__ void step(At at, float sl2, float& alpha0, float& alpha1) {
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      mx0 = fmaxf(mx0, fmaxf(at(n, 0), at(n, 1)));
      mx1 = fmaxf(mx1, fmaxf(at(n, 2), at(n, 3)));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0 * sl2);  // sl2 > 0, so scaling commutes with max
    const float mn1 = fmaxf(m1, mx1 * sl2);
    // A row with nothing visible yet keeps max -inf: subtract 0 instead, so exp2(-inf - 0) = 0, not NaN.
    const float mu0 = (mn0 == -INFINITY) ? 0.f : mn0;
    const float mu1 = (mn1 == -INFINITY) ? 0.f : mn1;
    alpha0 = pw_ptx::fast_exp2(m0 - mu0);  // m0 == -inf -> 0 (O and l are still 0 then)
    alpha1 = pw_ptx::fast_exp2(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      at(n, 0) = pw_ptx::fast_exp2(fmaf(at(n, 0), sl2, -mu0));
      at(n, 1) = pw_ptx::fast_exp2(fmaf(at(n, 1), sl2, -mu0));
      at(n, 2) = pw_ptx::fast_exp2(fmaf(at(n, 2), sl2, -mu1));
      at(n, 3) = pw_ptx::fast_exp2(fmaf(at(n, 3), sl2, -mu1));
      rs0 += at(n, 0) + at(n, 1);
      rs1 += at(n, 2) + at(n, 3);
    }
    l0 = l0 * alpha0 + rs0;
    l1 = l1 * alpha1 + rs1;
  }

  // After the last step: sum l over the quad (the four threads of a row) and return 1/l per row, 0 for a row
  // that saw no key.
  __device__ __forceinline__ void finalize(float& inv0, float& inv1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    inv0 = (l0 > 0.f) ? 1.f / l0 : 0.f;
    inv1 = (l1 > 0.f) ? 1.f / l1 : 0.f;
  }

  // After finalize: the natural-log log-sum-exp of the scaled logits of row h (0 or 1), -inf for a row that saw
  // no key.
  __device__ __forceinline__ float lse(int h) const {
    const float l = h ? l1 : l0;
    const float m = h ? m1 : m0;
    return (l > 0.f) ? (m + __log2f(l)) * kLn2 : -INFINITY;
  }
  // The same in the log2 domain (the decode kernel's split partials).
  __device__ __forceinline__ float lse_log2(int h) const {
    const float l = h ? l1 : l0;
    const float m = h ? m1 : m0;
    return (l > 0.f) ? m + __log2f(l) : -INFINITY;
  }
};

}  // namespace pw_softmax
