// Independent FMA chains in registers: enough to cover the FMA latency on every x86 core with two
// pipes (benchmarks/experiments/roofline.py's FMA peak).
#include <cstdint>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
constexpr int CHAINS = 12;
extern "C" int64_t ladle_fma_flops_per_iter() {
#if defined(__AVX512F__)
  return int64_t(CHAINS) * 16 * 2;
#elif defined(__AVX2__) && defined(__FMA__)
  return int64_t(CHAINS) * 8 * 2;
#else
  return 0;
#endif
}
extern "C" float ladle_fma_loop(int64_t iters) {
#if defined(__AVX512F__)
  __m512 acc[CHAINS];
  const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
  for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_set1_ps(float(j));
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_fmadd_ps(acc[j], b, c);
  __m512 s = acc[0];
  for (int j = 1; j < CHAINS; ++j) s = _mm512_add_ps(s, acc[j]);
  return _mm512_reduce_add_ps(s);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[CHAINS];
  const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
  for (int j = 0; j < CHAINS; ++j) acc[j] = _mm256_set1_ps(float(j));
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < CHAINS; ++j) acc[j] = _mm256_fmadd_ps(acc[j], b, c);
  float out[8], s = 0.0f;
  for (int j = 1; j < CHAINS; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  _mm256_storeu_ps(out, acc[0]);
  for (float v : out) s += v;
  return s;
#else
  (void)iters;
  return 0.0f;
#endif
}
