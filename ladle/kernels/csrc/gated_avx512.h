// The gated activation's AVX-512 loop, shared by the two CPU kernels that run it: fused.cpp (the
// activation kernel) and gemm.cpp (the down projection's GEMM with the activation in its row packing)
// must give bitwise the same values, so both include this one text and its operations and their order
// cannot drift apart. The includer declares `Fn16` (a 16-lane float function pointer, torch's SLEEF
// exp or tanh) and includes <immintrin.h> first; the loop exists only in an AVX-512 build.
#pragma once

#include <cstdint>
// torch's kBeta (M_SQRT2 * M_2_SQRTPI * 0.5 in double, rounded to float) and kKappa.
constexpr float kBeta = float(1.41421356237309504880 * 1.12837916709551257390 * 0.5);
constexpr float kKappa = 0.044715f;

#if defined(__AVX512F__)
// act(g) * u over n floats, 16 lanes at a time (a masked tail: every lane the same operations):
// SiLU g / (1 + exp(-g)) for act 0, tanh-GELU 0.5 g (1 + tanh(kBeta (g + kKappa g^3))) for act 1,
// with f torch's SLEEF exp (act 0) or tanh (act 1).
inline void gated_avx512(const float* g, const float* u, float* o, int64_t n, int act, Fn16 f) {
  const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
  const __m512 beta = _mm512_set1_ps(kBeta), kappa = _mm512_set1_ps(kKappa);
  const __m512i sign = _mm512_set1_epi32(int32_t(0x80000000u));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1u);
    const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
    __m512 y;
    if (act == 0) {
      const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
      y = _mm512_div_ps(x, _mm512_add_ps(one, f(neg)));
    } else {
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 t = f(_mm512_mul_ps(beta, _mm512_fmadd_ps(kappa, cube, x)));
      y = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, t));
    }
    _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(y, _mm512_maskz_loadu_ps(m, u + i)));
  }
}
#endif
