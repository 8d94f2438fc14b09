// The CPU paged attention kernel, built at first use by kernels/cpu_build.py. Its contract (argument
// struct, tile rule, determinism) is described in kernels/cpu_paged.py; `Args` is mirrored by
// kernels/cpu_structs.Args (checked at load against ladle_paged_layout()).

// ladle CPU paged attention: reads the paged KV cache in place, tiles of TILE keys at fixed absolute
// positions, online softmax in fp32 over the tiles in position order. One work item (sequence, KV
// head, block of query positions) is computed by one thread, and every query row's arithmetic is a
// fixed sequence of operations that depends only on its own position: bitwise the same result
// whatever the chunking, the batch, the query block or the thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

#include "layout.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#ifndef LADLE_TILE
#define LADLE_TILE 32
#endif
// The blocked score micro-kernel: up to RV row vectors (16 query rows each) x KJ keys per call, RV x KJ
// accumulators live in registers (plus RV query vectors and one broadcast key element).
#ifndef LADLE_BLOCK_RV
#if defined(__AVX512F__)
#define LADLE_BLOCK_RV 3
#define LADLE_BLOCK_KJ 8
#else
#define LADLE_BLOCK_RV 1
#define LADLE_BLOCK_KJ 4
#endif
#endif
// Row-wise scores request the next lines every LADLE_PF_EVERY dimensions of a 16-key block (a tile's
// worth spread over its blocks). With the requests going to L2 (Prefetcher::to_l2), 16 (once per 16 x 16
// block, 4 keys' rows at a time) measured 1.1-1.2x faster than 8 on a Zen 4 at head_dim 64 (32 decodes at
// context 400 and 64 at 700), and 32 or 64 (larger bursts) slower than 16.
#ifndef LADLE_PF_EVERY
#define LADLE_PF_EVERY 16
#endif
#ifndef LADLE_ROWWISE_MAX
#define LADLE_ROWWISE_MAX 8
#endif
// The score micro-kernel must be inlined whole: GCC's heuristics otherwise leave calls in it.
#define LADLE_INLINE __attribute__((always_inline)) inline
// Keep a loaded vector in a register: GCC otherwise folds the load into every FMA that uses it (one
// load per FMA instead of one per KJ: the score micro-kernel measured ~2x slower).
#if defined(__AVX512F__)
#define LADLE_IN_REGISTER(v) asm("" : "+v"(v.x))
#elif defined(__AVX2__) && defined(__FMA__)
#define LADLE_IN_REGISTER(v) asm("" : "+x"(v.lo), "+x"(v.hi))
#else
#define LADLE_IN_REGISTER(v) (void)(v)
#endif

namespace {

constexpr int TILE = LADLE_TILE;
static_assert(TILE % 16 == 0 && TILE >= 16 && TILE <= 64, "TILE must be 16, 32, 48 or 64");
constexpr int TV = TILE / 16;       // 16-lane vectors per tile row
constexpr int BR = 48;              // query rows per block of the blocked (prefill) path: 3 row vectors
constexpr int RV = LADLE_BLOCK_RV;  // row vectors per blocked score micro-kernel
constexpr int KJ = LADLE_BLOCK_KJ;  // keys per blocked score micro-kernel
static_assert(RV >= 1 && RV <= 3, "LADLE_BLOCK_RV must be 1, 2 or 3");
// Rows per KV head up to which scores go row-wise (lanes over keys: a transposed key tile is shared by
// the rows, every lane busy), blocked beyond (lanes over rows: 16 rows share each key element). Measured
// at 8 rows (GQA 8 decodes, context 1024, head_dim 64): row-wise 1.27x faster than blocked at batch 32,
// 1.1x at batch 1; at head_dim 128, as fast.
constexpr int ROWWISE_MAX = LADLE_ROWWISE_MAX;
constexpr int ROWWISE_MAX_ROWS = 8;  // the row-wise micro-kernels' limit
static_assert(ROWWISE_MAX <= ROWWISE_MAX_ROWS, "LADLE_ROWWISE_MAX must be at most 8");
#ifndef LADLE_PV_ROWS
#define LADLE_PV_ROWS 6
#endif
constexpr int PV_ROWS = LADLE_PV_ROWS;  // query rows per PV micro-kernel (at most 6)
constexpr int PV_COLS = 4;              // 16-lane output chunks per PV micro-kernel
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------- 16-lane vectors
// Every operation is lane-wise (or a fixed tree for the reductions), so a lane's result never
// depends on which other lanes are in use.
#if defined(__AVX512F__)
struct V { __m512 x; };
using Mask = __mmask16;
inline Mask tail_mask(int n) { return n >= 16 ? Mask(0xFFFF) : Mask((1u << n) - 1u); }
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset(float a) { return {_mm512_set1_ps(a)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V vload_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(tail_mask(n), p)}; }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.x); }
inline V operator+(V a, V b) { return {_mm512_add_ps(a.x, b.x)}; }
inline V operator-(V a, V b) { return {_mm512_sub_ps(a.x, b.x)}; }
inline V operator*(V a, V b) { return {_mm512_mul_ps(a.x, b.x)}; }
inline V operator/(V a, V b) { return {_mm512_div_ps(a.x, b.x)}; }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.x, b.x, c.x)}; }
inline V vfma_if(bool on, V a, V b, V c) { return {_mm512_mask3_fmadd_ps(a.x, b.x, c.x, on ? Mask(0xFFFF) : Mask(0))}; }
inline V vmax(V a, V b) { return {_mm512_max_ps(a.x, b.x)}; }
inline V vmin(V a, V b) { return {_mm512_min_ps(a.x, b.x)}; }
inline V vabs(V a) { return {_mm512_abs_ps(a.x)}; }
inline V vselect(Mask m, V a, V b) { return {_mm512_mask_blend_ps(m, b.x, a.x)}; }
inline Mask vlt(V a, V b) { return _mm512_cmp_ps_mask(a.x, b.x, _CMP_LT_OQ); }
inline V vround(V a) { return {_mm512_roundscale_ps(a.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V vldexp(V p, V n) { return {_mm512_scalef_ps(p.x, n.x)}; }
inline V vcopysign(V mag, V sgn) {
  const __m512i m = _mm512_set1_epi32(0x7fffffff);
  return {_mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(mag.x), m),
                                              _mm512_andnot_si512(m, _mm512_castps_si512(sgn.x))))};
}
// Tree: lanes l + l+8, then l + l+4, l + l+2, l + l+1 (the generic version below uses the same tree).
inline float vhsum(V a) {
  __m256 s8 =
      _mm256_add_ps(_mm512_castps512_ps256(a.x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.x), 1)));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
inline float vhmax(V a) { return _mm512_reduce_max_ps(a.x); }
inline Mask lanes_in(int lo, int hi) {
  lo = std::clamp(lo, 0, 16);
  hi = std::clamp(hi, 0, 16);
  if (hi <= lo) return 0;
  return Mask(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}
// 16x16 transpose of r[0..15] in place.
inline void transpose16(V* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i].x, r[2 * i + 1].x);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i].x, r[2 * i + 1].x);
  }
  __m512 u[16];
  for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int c = 0; c < 4; ++c) {
    __m512 x = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), y = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    __m512 x2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    __m512 y2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c].x = _mm512_shuffle_f32x4(x, x2, 0x88);
    r[8 + c].x = _mm512_shuffle_f32x4(x, x2, 0xDD);
    r[4 + c].x = _mm512_shuffle_f32x4(y, y2, 0x88);
    r[12 + c].x = _mm512_shuffle_f32x4(y, y2, 0xDD);
  }
}
// out[d] = [r[0][d], ..., r[15][d]] for d < 16: the 16 x 16 transpose of the rows at r, with half the
// shuffles of transpose16 (the 128-bit pieces land in place as broadcast loads, then a 4 x 4 transpose
// in each 128-bit lane).
#define LADLE_HAS_TRANSPOSE_LOAD 1
inline void transpose16_load(const float* const* r, V* out) {
  for (int q = 0; q < 4; ++q) {
    __m512 x[4];
    for (int a = 0; a < 4; ++a) {
      __m512 v = _mm512_castps128_ps512(_mm_loadu_ps(r[a] + 4 * q));
      v = _mm512_mask_broadcast_f32x4(v, 0x00F0, _mm_loadu_ps(r[4 + a] + 4 * q));
      v = _mm512_mask_broadcast_f32x4(v, 0x0F00, _mm_loadu_ps(r[8 + a] + 4 * q));
      x[a] = _mm512_mask_broadcast_f32x4(v, 0xF000, _mm_loadu_ps(r[12 + a] + 4 * q));
    }
    const __m512d t0 = _mm512_castps_pd(_mm512_unpacklo_ps(x[0], x[1]));
    const __m512d t1 = _mm512_castps_pd(_mm512_unpackhi_ps(x[0], x[1]));
    const __m512d t2 = _mm512_castps_pd(_mm512_unpacklo_ps(x[2], x[3]));
    const __m512d t3 = _mm512_castps_pd(_mm512_unpackhi_ps(x[2], x[3]));
    out[4 * q].x = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    out[4 * q + 1].x = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    out[4 * q + 2].x = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    out[4 * q + 3].x = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
}
#define LADLE_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
// Two 8-lane halves; the same operations lane by lane (and the same trees) as the AVX-512 version.
struct V { __m256 lo, hi; };
using Mask = uint32_t;
inline __m256 half_mask(uint32_t bits8) {
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_set1_epi32(int(bits8));
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, lane), lane));
}
inline __m256i count_mask(int n) {  // lanes < n
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V vload_n(const float* p, int n) {
  return {_mm256_maskload_ps(p, count_mask(n)), _mm256_maskload_ps(p + 8, count_mask(n - 8))};
}
inline void vstore(float* p, V a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V operator+(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V operator-(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V operator*(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V operator/(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V vfma_if(bool on, V a, V b, V c) { return on ? vfma(a, b, c) : c; }
inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V vmin(V a, V b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V vabs(V a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline V vselect(Mask m, V a, V b) {
  return {_mm256_blendv_ps(b.lo, a.lo, half_mask(m & 0xffu)), _mm256_blendv_ps(b.hi, a.hi, half_mask(m >> 8))};
}
inline Mask vlt(V a, V b) {
  return Mask(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ))) |
         Mask(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ))) << 8;
}
inline V vround(V a) {
  constexpr int m = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, m), _mm256_round_ps(a.hi, m)};
}
// p * 2^n for integral n in [-126, 126] (2^n is then a normal float, the product rounds once).
inline V vldexp(V p, V n) {
  auto pow2 = [](__m256 e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23));
  };
  return {_mm256_mul_ps(p.lo, pow2(n.lo)), _mm256_mul_ps(p.hi, pow2(n.hi))};
}
inline V vcopysign(V mag, V sgn) {
  const __m256 s = _mm256_castsi256_ps(_mm256_set1_epi32(int(0x80000000u)));
  return {_mm256_or_ps(_mm256_andnot_ps(s, mag.lo), _mm256_and_ps(s, sgn.lo)),
          _mm256_or_ps(_mm256_andnot_ps(s, mag.hi), _mm256_and_ps(s, sgn.hi))};
}
inline float vhsum(V a) {
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
inline float vhmax(V a) {
  const __m256 s8 = _mm256_max_ps(a.lo, a.hi);
  const __m128 s4 = _mm_max_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_max_ss(s2, _mm_movehdup_ps(s2)));
}
inline Mask lanes_in(int lo, int hi) {
  lo = std::clamp(lo, 0, 16);
  hi = std::clamp(hi, 0, 16);
  if (hi <= lo) return 0;
  return Mask(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}
// 8x8 transpose of r[0..7] in place.
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}
// 16x16 transpose of r[0..15] in place, as four 8x8 blocks.
inline void transpose16(V* r) {
  __m256 a[8], b[8], c[8], d[8];  // rows 0-7 lo/hi, rows 8-15 lo/hi
  for (int i = 0; i < 8; ++i) {
    a[i] = r[i].lo;
    b[i] = r[i].hi;
    c[i] = r[8 + i].lo;
    d[i] = r[8 + i].hi;
  }
  transpose8(a);
  transpose8(b);
  transpose8(c);
  transpose8(d);
  for (int i = 0; i < 8; ++i) {
    r[i] = {a[i], c[i]};
    r[8 + i] = {b[i], d[i]};
  }
}
#define LADLE_ISA "avx2"
#else
struct V { float x[16]; };
using Mask = uint32_t;
#if defined(__FMA__) || defined(__aarch64__)
inline float fma1(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
inline float fma1(float a, float b, float c) { return a * b + c; }  // built with -ffp-contract=off
#endif
#define LADLE_LANES(expr)                       \
  V r;                                          \
  for (int l = 0; l < 16; ++l) r.x[l] = (expr); \
  return r
inline V vzero() { LADLE_LANES(0.0f); }
inline V vset(float a) { LADLE_LANES(a); }
inline V vload(const float* p) { LADLE_LANES(p[l]); }
inline V vload_n(const float* p, int n) { LADLE_LANES(l < n ? p[l] : 0.0f); }
inline void vstore(float* p, V a) {
  for (int l = 0; l < 16; ++l) p[l] = a.x[l];
}
inline V operator+(V a, V b) { LADLE_LANES(a.x[l] + b.x[l]); }
inline V operator-(V a, V b) { LADLE_LANES(a.x[l] - b.x[l]); }
inline V operator*(V a, V b) { LADLE_LANES(a.x[l] * b.x[l]); }
inline V operator/(V a, V b) { LADLE_LANES(a.x[l] / b.x[l]); }
inline V vfma(V a, V b, V c) { LADLE_LANES(fma1(a.x[l], b.x[l], c.x[l])); }
inline V vfma_if(bool on, V a, V b, V c) { return on ? vfma(a, b, c) : c; }
inline V vmax(V a, V b) { LADLE_LANES(a.x[l] > b.x[l] ? a.x[l] : b.x[l]); }
inline V vmin(V a, V b) { LADLE_LANES(a.x[l] < b.x[l] ? a.x[l] : b.x[l]); }
inline V vabs(V a) { LADLE_LANES(std::fabs(a.x[l])); }
inline V vselect(Mask m, V a, V b) { LADLE_LANES((m >> l) & 1u ? a.x[l] : b.x[l]); }
inline Mask vlt(V a, V b) {
  Mask m = 0;
  for (int l = 0; l < 16; ++l) m |= Mask(a.x[l] < b.x[l]) << l;
  return m;
}
inline V vround(V a) { LADLE_LANES(std::nearbyint(a.x[l])); }
inline V vldexp(V p, V n) { LADLE_LANES(std::ldexp(p.x[l], int(n.x[l]))); }
inline V vcopysign(V mag, V sgn) { LADLE_LANES(std::copysign(mag.x[l], sgn.x[l])); }
inline float vhsum(V a) {
  for (int h = 8; h >= 1; h /= 2)
    for (int l = 0; l < h; ++l) a.x[l] = a.x[l] + a.x[l + h];
  return a.x[0];
}
inline float vhmax(V a) {
  float m = a.x[0];
  for (int l = 1; l < 16; ++l) m = a.x[l] > m ? a.x[l] : m;
  return m;
}
inline Mask lanes_in(int lo, int hi) {
  Mask m = 0;
  for (int l = 0; l < 16; ++l) m |= Mask(l >= lo && l < hi) << l;
  return m;
}
inline void transpose16(V* r) {
  for (int i = 0; i < 16; ++i)
    for (int j = i + 1; j < 16; ++j) std::swap(r[i].x[j], r[j].x[i]);
}
#define LADLE_ISA "generic"
#endif

// 2^x for x in [-126, 126] (clamped): Taylor polynomial of degree 7 on the fraction, exact scaling.
inline V vexp2(V x) {
  x = vmin(vmax(x, vset(-126.0f)), vset(126.0f));
  V n = vround(x);
  V f = x - n;
  V p = vset(1.5252734e-5f);
  p = vfma(p, f, vset(1.5403530e-4f));
  p = vfma(p, f, vset(1.3333558e-3f));
  p = vfma(p, f, vset(9.6181291e-3f));
  p = vfma(p, f, vset(5.5504109e-2f));
  p = vfma(p, f, vset(2.4022651e-1f));
  p = vfma(p, f, vset(6.9314718e-1f));
  p = vfma(p, f, vset(1.0f));
  return vldexp(p, n);
}

// tanh: odd Taylor series below |x| = 0.3, 1 - 2 / (e^{2|x|} + 1) above (with the sign of x).
inline V vtanh(V x) {
  V ax = vabs(x);
  V e = vexp2(vmin(ax, vset(9.0f)) * vset(2.0f * kLog2e));
  V big = vset(1.0f) - vset(2.0f) / (e + vset(1.0f));
  V x2 = x * x;
  V poly = vset(-1382.0f / 155925.0f);
  poly = vfma(poly, x2, vset(62.0f / 2835.0f));
  poly = vfma(poly, x2, vset(-17.0f / 315.0f));
  poly = vfma(poly, x2, vset(2.0f / 15.0f));
  poly = vfma(poly, x2, vset(-1.0f / 3.0f));
  V small = vfma(x * x2, poly, x);
  return vselect(vlt(ax, vset(0.3f)), small, vcopysign(big, x));
}

// ---------------------------------------------------------------- element types
struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

inline float to_f32(float v) { return v; }
inline float to_f32(BF16 v) {
  uint32_t u = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_f32(F16 v) {
  const uint32_t h = v.bits, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    float f = std::ldexp(float(man), -24);  // zero or subnormal: exact
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// n (<= 16) elements of p as fp32, zeros beyond.
template <class T>
inline V load16(const T* p, int n) {
  alignas(64) float tmp[16];
  for (int l = 0; l < 16; ++l) tmp[l] = l < n ? to_f32(p[l]) : 0.0f;
  return vload(tmp);
}
template <>
inline V load16<float>(const float* p, int n) {
  return n >= 16 ? vload(p) : vload_n(p, n);
}

// Cache lines of the next tile, requested a few at a time from inside the compute loops so that
// reading one tile overlaps the arithmetic of the previous one (requesting them all at once fills the
// core's miss buffers and stalls it until they arrive). Lines are walked key by key: the key's K row,
// then its V row.
//
// Where to: row-wise items (decodes) request into L2 (prefetcht1), blocked ones into L1 (prefetcht0).
// A decode streams its K/V from DRAM and reads each line once; requests into L1 likely hold the core's
// few L1 miss slots until the lines arrive, so the loads of the arithmetic queue behind them. Measured on
// a Zen 4 EPYC (1 thread, head-major cache on scattered blocks, 16 / 8 heads x 64): 32 decodes at context
// 400 1.4-1.7x, 64 at 700 1.5-1.8x faster into L2; prefetchnta no faster than L1. The blocked path reads each key from
// L1 many times and measured as fast or 1-5% faster into L1.
struct Prefetcher {
  const char* k = nullptr;  // K plane + head offset, in bytes
  const char* v = nullptr;
  const int64_t* off = nullptr;  // element offsets of the keys' rows
  int64_t es = 4;
  int j = 0, end = 0, row_bytes = 0;  // next key to request, end of the tile's keys
  int x = 0, unit = 8;                // next byte of key j's rows; lines per issue(1): one head's K and V row of a key
  bool per_head = true;               // rows of one head: issue(n) is n keys (a cheaper loop)
  bool to_l2 = false;                 // request into L2 (row-wise items) rather than L1; set per item
  void clear() { j = end = 0; }
  // Rows of `bytes` (one head's, or all heads' of a key: a whole cache row) of the keys [ks, ke).
  void plan(const char* kc, const char* vc, const int64_t* o, int64_t elem, int bytes, int head_bytes, int ks, int ke) {
    k = kc;
    v = vc;
    off = o;
    es = elem;
    j = ks;
    end = ke;
    row_bytes = bytes;
    x = 0;
    unit = 2 * ((head_bytes + 63) / 64);
    per_head = bytes == head_bytes;
  }
  // The next n units of lines: n keys' rows of one head, a fraction of a key's whole rows.
  inline void issue(int n) {
    if (to_l2)
      issue_to<2>(n);
    else
      issue_to<3>(n);
  }
  // __builtin_prefetch's locality: 3 = prefetcht0 (L1), 2 = prefetcht1 (L2).
  template <int LOCALITY>
  inline void issue_to(int n) {
    if (per_head) {  // one head's rows: n keys
      for (; n > 0 && j < end; --n, ++j) {
        const char* kr = k + off[j] * es;
        const char* vr = v + off[j] * es;
        for (int b = 0; b < row_bytes; b += 64) {
          __builtin_prefetch(kr + b, 0, LOCALITY);
          __builtin_prefetch(vr + b, 0, LOCALITY);
        }
      }
      return;
    }
    for (int lines = n * unit; lines > 0 && j < end;) {
      const char* kr = k + off[j] * es;
      const char* vr = v + off[j] * es;
      const int stop = std::min(row_bytes, x + 32 * lines);  // 64-byte lines, K and V: 2 per step
      lines -= (stop - x + 63) / 64 * 2;
      for (; x < stop; x += 64) {
        __builtin_prefetch(kr + x, 0, LOCALITY);
        __builtin_prefetch(vr + x, 0, LOCALITY);
      }
      if (x >= row_bytes) {
        x = 0;
        ++j;
      }
    }
  }
  void flush() {
    while (j < end) issue(TILE);
  }
};

// ---------------------------------------------------------------- arguments
struct Args {
  const void* q;  // [T, H, D], last dim contiguous
  int64_t q_stride_t, q_stride_h;
  float* out;           // [T, H, D] contiguous fp32
  const void* k_cache;  // a plane: block b, token i, head h at element b * kv_stride_block + i * kv_stride_token +
  const void* v_cache;  // h * kv_stride_head, head_dim contiguous (token-major NHD or head-major HND blocks)
  const void* k_new;    // [T, Hkv, D] written at slot_mapping before attending; null: already written
  const void* v_new;
  int64_t k_stride_t, k_stride_h, v_stride_t, v_stride_h;
  const int64_t* slot_mapping;     // [T]
  const int32_t* query_start_loc;  // [B + 1]
  const int32_t* seq_lens;         // [B]
  const int32_t* block_tables;     // [B, bt_stride]
  int64_t bt_stride;
  int32_t num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, block_size;
  int32_t q_dtype, kv_dtype;  // 0 float32, 1 bfloat16, 2 float16
  int32_t window;             // 0: none
  float scale, softcap;       // softcap 0: none
  int32_t num_threads, positions_per_item;
  // Cache strides in elements; last, so that a library built before them (a benchmark's baseline) still
  // finds every other field where it expects it.
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
};

// Which lines an item requests ahead (Kernel::plan_head_prefetch).
enum class Walk { head, heads, rows };

// A key's rows of every head are one contiguous cache row (token-major blocks).
inline bool whole_rows(const Args& a) {
  return a.kv_stride_head == a.head_dim && a.kv_stride_token == int64_t(a.num_kv_heads) * a.head_dim;
}

struct Item {
  int32_t b, h0, h1, i0, i1;  // sequence, KV heads [h0, h1), query rows [i0, i1) of the sequence's chunk
  int64_t cost;
};

// Cache-line aligned storage: a 16-lane vector load or store that straddles two lines costs two (the
// scratch rows are read and written whole; measured +8% on a tile loop in L1, +2-5% on prefill chunks).
template <class T>
struct Aligned {
  using value_type = T;
  Aligned() = default;
  template <class U>
  Aligned(const Aligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const Aligned<U>&) const {
    return true;
  }
  template <class U>
  bool operator!=(const Aligned<U>&) const {
    return false;
  }
};
using Floats = std::vector<float, Aligned<float>>;

struct Scratch {
  Floats qp, qt, kc, zero, st, vc, p, acc, m, l, alpha, pos;
  std::vector<const float*> vrow;
  std::vector<int32_t> jlo, jhi, ipos;
  Prefetcher pf;
  // rows: the item's rows (padded to whole blocks on the blocked path).
  void ensure(int rows, int dp) {
    auto grow = [](auto& v, size_t n) {
      if (v.size() < n) v.resize(n);
    };
    grow(qp, size_t(rows) * dp);
    grow(qt, size_t(rows) * dp);
    grow(kc, size_t(TILE) * dp);
    if (zero.size() < size_t(dp)) zero.assign(dp, 0.0f);
    grow(st, size_t(TILE + KJ) * BR);
    grow(vc, size_t(TILE) * dp);
    grow(p, size_t(rows) * TILE);
    grow(acc, size_t(rows) * dp);
    grow(m, rows);
    grow(l, rows);
    grow(alpha, rows);
    grow(vrow, TILE);
    grow(jlo, rows);
    grow(jhi, rows);
    grow(pos, rows);
    grow(ipos, rows);
  }
};

inline int round16(int d) { return (d + 15) / 16 * 16; }

// ---------------------------------------------------------------- scores
// The score of query row r and key j, whichever layout computes it: one fused multiply-add per
// dimension, in increasing d, from +0:
//   s = fma(q[r][D-1], k[j][D-1], ... fma(q[r][1], k[j][1], fma(q[r][0], k[j][0], +0)))
// (a single chain per (row, key): no partial sums, no tree). Row-wise (few rows: decodes) runs lanes
// over 16 keys: the tile's keys are transposed once per head and each query element is broadcast.
// Blocked (many rows: prefill chunks) runs lanes over 16 query rows: the block's queries are
// transposed once per work item, the tile's key rows copied into a contiguous buffer, and each key
// element is broadcast to 16 rows. Each lane does the same chain of operations: the same bits.

// Row-wise: N query rows (qp, dp apart) against the keys [ks, ke) of a tile (rows at krow; zeros for
// the other keys), lanes over 16 keys: each 16 keys x 16 dimensions block is transposed in registers
// and its 16 dimensions go straight into the rows' chains. Scores to s [N][TILE]. Requests `pf` lines as
// it goes (a tile's worth of keys spread over the blocks' loads: a burst fills the miss buffers).
template <int N, class KT>
inline void qk_rowwise(const float* qp, int dp, const KT* const* krow, int ks, int ke, int d_len, float* s,
                       Prefetcher& pf) {
  alignas(64) static constexpr float zero16[16] = {};
  const int blocks = TV * ((d_len + 15) / 16), per_load = (TILE * LADLE_PF_EVERY + 16 * blocks - 1) / (16 * blocks);
  int credit = TILE;  // prefetch units (a key's rows of one head) still to request for this head
  for (int t = 0; t < TV; ++t) {
    const int j0 = 16 * t;
    V acc[N];
    for (int r = 0; r < N; ++r) acc[r] = vzero();
    if (j0 + 16 > ks && j0 < ke) {
      for (int c = 0; c < d_len; c += 16) {
        const int n = std::min(16, d_len - c);
        V rows[16];
#if defined(LADLE_HAS_TRANSPOSE_LOAD)
        if (std::is_same_v<KT, float> && n == 16) {
          const float* src[16];
          for (int i = 0; i < 16; ++i)
            src[i] = j0 + i >= ks && j0 + i < ke ? reinterpret_cast<const float*>(krow[j0 + i]) + c : zero16;
          transpose16_load(src, rows);
        } else
#endif
        {
          for (int i = 0; i < 16; ++i) {
            const int j = j0 + i;
            rows[i] = j >= ks && j < ke ? load16(krow[j] + c, n) : vzero();
          }
          transpose16(rows);
        }
        for (int i = 0; i < n; ++i) {
          if (i % LADLE_PF_EVERY == 0 && credit > 0) {
            pf.issue(per_load);
            credit -= per_load;
          }
          for (int r = 0; r < N; ++r) acc[r] = vfma(vset(qp[size_t(r) * dp + c + i]), rows[i], acc[r]);
        }
      }
    }
    for (int r = 0; r < N; ++r) vstore(s + size_t(r) * TILE + j0, acc[r]);
  }
}

template <class KT, int N = ROWWISE_MAX_ROWS>
inline void qk_rowwise_n(const float* qp, int dp, int rows, const KT* const* krow, int ks, int ke, int d_len, float* s,
                         Prefetcher& pf) {
  if constexpr (N >= 1) {
    if (rows == N) return qk_rowwise<N, KT>(qp, dp, krow, ks, ke, d_len, s, pf);
    return qk_rowwise_n<KT, N - 1>(qp, dp, rows, krow, ks, ke, d_len, s, pf);
  }
}

// Blocked: R row vectors (16 rows each, transposed queries qt [Dp][BR]) x KJ key rows, all R x KJ
// chains in registers. Scores land key by key: key k's 16 R lanes at st + k * BR.
template <int R>
LADLE_INLINE void qk_block_kernel(const float* qt, const float* const* krow, int d_len, float* st) {
  V acc[R][KJ];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < KJ; ++k) acc[r][k] = vzero();
  const float* kp[KJ];
  for (int k = 0; k < KJ; ++k) kp[k] = krow[k];
  for (int d = 0; d < d_len; ++d) {
    V qv[R];
    for (int r = 0; r < R; ++r) {
      qv[r] = vload(qt + size_t(d) * BR + 16 * r);
      LADLE_IN_REGISTER(qv[r]);
    }
    for (int k = 0; k < KJ; ++k) {
      V kb = vset(kp[k][d]);
      LADLE_IN_REGISTER(kb);
      for (int r = 0; r < R; ++r) acc[r][k] = vfma(qv[r], kb, acc[r][k]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < KJ; ++k) vstore(st + size_t(k) * BR + 16 * r, acc[r][k]);
}

// Scores of the first nv row vectors of a block against the keys [jlo, jhi) (KJ at a time: krow must
// hold valid rows up to jhi rounded up to KJ).
inline void qk_block(const float* qt, int nv, const float* const* krow, int jlo, int jhi, int d_len, float* st,
                     Prefetcher& pf) {
  for (int v = 0; v < nv; v += RV) {
    const float* q = qt + 16 * v;
    float* out = st + 16 * v;
    const int r = std::min(RV, nv - v);
    for (int j = jlo; j < jhi; j += KJ, pf.issue(KJ)) {
      if (RV >= 3 && r == 3)
        qk_block_kernel<3>(q, krow + j, d_len, out + size_t(j) * BR);
      else if (RV >= 2 && r == 2)
        qk_block_kernel<2>(q, krow + j, d_len, out + size_t(j) * BR);
      else
        qk_block_kernel<1>(q, krow + j, d_len, out + size_t(j) * BR);
    }
  }
}

// ---------------------------------------------------------------- values
// acc[r] = acc[r] * alpha[r], then acc[r] += p(r, j) * v[j] for j in [jlo, jhi) in order, over the output
// lanes [d0, d0 + 16 * C) (or the last `tail` lanes when TAIL); p(r, j) = p[j * BR + r] (PT: a block's
// transposed probabilities) or p[r * TILE + j]. MASKED:
// row r only takes the keys [lo[r], hi[r]) (a masked fused multiply-add leaves the others untouched),
// so rows that see different keys of a tile still share the value loads.
template <bool PT, int R, int C, bool TAIL, bool MASKED>
inline void pv_rows(float* acc, int dp, const float* p, const float* alpha, const int32_t* lo, const int32_t* hi,
                    const float* const* vrow, int jlo, int jhi, int d0, int tail) {
  V a[R][C];
  for (int r = 0; r < R; ++r) {
    const V al = vset(alpha[r]);
    for (int c = 0; c < C; ++c) a[r][c] = vload(acc + size_t(r) * dp + d0 + 16 * c) * al;
  }
  auto keys = [&](int j0, int j1, auto masked) {
    for (int j = j0; j < j1; ++j) {
      const float* vr = vrow[j] + d0;
      V vv[C];
      for (int c = 0; c < C; ++c) vv[c] = TAIL ? vload_n(vr, tail) : vload(vr + 16 * c);
      for (int r = 0; r < R; ++r) {
        const V pb = vset(PT ? p[size_t(j) * BR + r] : p[size_t(r) * TILE + j]);
        if constexpr (decltype(masked)::value) {
          const bool on = j >= lo[r] && j < hi[r];
          for (int c = 0; c < C; ++c) a[r][c] = vfma_if(on, pb, vv[c], a[r][c]);
        } else {
          for (int c = 0; c < C; ++c) a[r][c] = vfma(pb, vv[c], a[r][c]);
        }
      }
    }
  };
  if constexpr (MASKED) {
    // Keys every row sees go unmasked; only the ends of the range (the rows' differences) are masked.
    // A row that sees no key here makes the middle empty (its lo >= its hi).
    int lo_max = jlo, hi_min = jhi;
    for (int r = 0; r < R; ++r) {
      lo_max = std::max(lo_max, lo[r]);
      hi_min = std::min(hi_min, hi[r]);
    }
    lo_max = std::min(lo_max, jhi);
    hi_min = std::max(hi_min, lo_max);
    keys(jlo, lo_max, std::true_type{});
    keys(lo_max, hi_min, std::false_type{});
    keys(hi_min, jhi, std::true_type{});
  } else {
    keys(jlo, jhi, std::false_type{});
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore(acc + size_t(r) * dp + d0 + 16 * c, a[r][c]);
}

template <bool PT, int R, bool MASKED>
inline void pv_group_r(float* acc, int dp, const float* p, const float* alpha, const int32_t* lo, const int32_t* hi,
                       const float* const* vrow, int jlo, int jhi, int d_len) {
  const int full = d_len / 16, tail = d_len % 16;
  int c = 0;
  for (; c + PV_COLS <= full; c += PV_COLS)
    pv_rows<PT, R, PV_COLS, false, MASKED>(acc, dp, p, alpha, lo, hi, vrow, jlo, jhi, 16 * c, 0);
  for (; c < full; ++c) pv_rows<PT, R, 1, false, MASKED>(acc, dp, p, alpha, lo, hi, vrow, jlo, jhi, 16 * c, 0);
  if (tail) pv_rows<PT, R, 1, true, MASKED>(acc, dp, p, alpha, lo, hi, vrow, jlo, jhi, 16 * full, tail);
}

// `rows` (1..PV_ROWS) rows against the keys [jlo, jhi); masked by lo/hi when `masked`.
template <bool PT>
inline void pv_group(float* acc, int dp, const float* p, const float* alpha, const int32_t* lo, const int32_t* hi,
                     const float* const* vrow, int jlo, int jhi, int d_len, int rows, bool masked) {
#define LADLE_PV(R)                                                                         \
  return masked ? pv_group_r<PT, R, true>(acc, dp, p, alpha, lo, hi, vrow, jlo, jhi, d_len) \
                : pv_group_r<PT, R, false>(acc, dp, p, alpha, lo, hi, vrow, jlo, jhi, d_len)
  switch (rows) {
    case 1:
      LADLE_PV(1);
    case 2:
      LADLE_PV(2);
    case 3:
      LADLE_PV(3);
    case 4:
      LADLE_PV(4);
    case 5:
      LADLE_PV(5);
    default:
      LADLE_PV(6);
  }
#undef LADLE_PV
}

// ---------------------------------------------------------------- one work item
template <class KT>
struct Kernel {
  const Args& a;
  int G, D, Dp;

  // Element offsets in a cache plane of the keys [ks, ke) of the tile at absolute position t0 (head 0's
  // row; head h's is kv_stride_head * h further): one division per tile, then a walk along the block table.
  void tile_offsets(const int32_t* bt, int t0, int ks, int ke, int64_t* off) const {
    int pos = t0 + ks, blk = pos / a.block_size, in = pos % a.block_size;
    for (int j = ks; j < ke; ++j) {
      off[j] = int64_t(bt[blk]) * a.kv_stride_block + int64_t(in) * a.kv_stride_token;
      if (++in == a.block_size) {
        in = 0;
        ++blk;
      }
    }
  }

  // The K and V lines of head h of the keys [ks, ke) of a tile at offsets off, for the prefetcher.
  void plan_prefetch(const int64_t* off, int ks, int ke, int h, Prefetcher& pf) const {
    const int64_t es = sizeof(KT), hoff = head_offset(h) * es;
    pf.plan(static_cast<const char*>(a.k_cache) + hoff, static_cast<const char*>(a.v_cache) + hoff, off, es,
            int(D * es), int(D * es), ks, ke);
  }

  // The whole cache rows (every KV head) of those keys: for items that take all heads of a sequence,
  // read in address order (each block's rows are contiguous), spread over the heads' computations.
  // Token-major blocks only (whole_rows); in head-major ones each head's rows are contiguous already.
  void plan_prefetch_rows(const int64_t* off, int ks, int ke, Prefetcher& pf) const {
    const int64_t es = sizeof(KT);
    pf.plan(static_cast<const char*>(a.k_cache), static_cast<const char*>(a.v_cache), off, es,
            int(a.num_kv_heads * D * es), int(D * es), ks, ke);
  }

  // Head h's row from a key's offset, in elements.
  int64_t head_offset(int h) const { return int64_t(h) * a.kv_stride_head; }

  // Key j's value row (head at element hoff): the cache itself (fp32) or s.vc (converted).
  void value_row(const int64_t* off, int64_t hoff, int j, Scratch& s) const {
    const KT* vc = static_cast<const KT*>(a.v_cache) + hoff;
    if constexpr (std::is_same_v<KT, float>) {
      s.vrow[j] = vc + off[j];
    } else {
      float* dst = s.vc.data() + size_t(j) * Dp;
      for (int d = 0; d < D; ++d) dst[d] = to_f32(vc[off[j] + d]);
      s.vrow[j] = dst;
    }
  }

  // Row pointers of the keys [ks, ke) of a tile (rows at off, head at element hoff) into krow (null
  // elsewhere), and of their values into s.vrow.
  void tile_rows(const int64_t* off, int64_t hoff, int ks, int ke, const KT** krow, Scratch& s) const {
    const KT* kc = static_cast<const KT*>(a.k_cache) + hoff;
    for (int j = 0; j < TILE; ++j) {
      krow[j] = nullptr;
      if (j < ks || j >= ke) continue;
      krow[j] = kc + off[j];
      value_row(off, hoff, j, s);
    }
  }

  // The blocked path's key and value rows, copied (as fp32, zero-padded to Dp) into contiguous tiles
  // s.kc and s.vc when the cache is token-major: one head's rows are then num_kv_heads * head_dim apart
  // and blocks multiples of 4 KiB apart, so a tile's rows fall in a few L1 sets and evict each other,
  // and every block of rows reads them again. fp32 rows of a head_dim that is a multiple of 16 are used
  // in place when a head's rows of a block are contiguous (head-major blocks: measured 1.02-1.045x faster
  // than copying on 512-token chunks at head_dim 64 and 128), or when each row is read about once (one
  // row vector, <= 16 rows a head: decodes of large query groups, short chunks). krow: the zero row for
  // keys outside [ks, ke) (up to TILE + KJ, the micro-kernel's overrun).
  void block_rows(const int64_t* off, int64_t hoff, int ks, int ke, int nqg, const float** krow, Scratch& s) const {
    const KT* kc = static_cast<const KT*>(a.k_cache) + hoff;
    const KT* vc = static_cast<const KT*>(a.v_cache) + hoff;
    for (int j = 0; j < TILE + KJ; ++j) {
      krow[j] = s.zero.data();
      if (j < ks || j >= ke) continue;
      if constexpr (std::is_same_v<KT, float>) {
        if (D == Dp && (nqg <= 16 || a.kv_stride_token == D)) {
          krow[j] = kc + off[j];
          s.vrow[j] = vc + off[j];
          continue;
        }
      }
      float* kd = s.kc.data() + size_t(j) * Dp;
      float* vd = s.vc.data() + size_t(j) * Dp;
      copy_row(kc + off[j], kd);
      copy_row(vc + off[j], vd);
      krow[j] = kd;
      s.vrow[j] = vd;
    }
  }

  // head_dim elements as fp32, zeros up to Dp.
  void copy_row(const KT* src, float* dst) const {
    int d = 0;
    if constexpr (std::is_same_v<KT, float>) {
      for (; d + 16 <= D; d += 16) vstore(dst + d, vload(src + d));
    }
    for (; d < D; ++d) dst[d] = to_f32(src[d]);
    for (; d < Dp; ++d) dst[d] = 0.0f;
  }

  // Row r's visible keys in the tile at t0, [lo, hi) (empty when lo >= hi): a function of its position.
  int visible_lo(int pos, int t0) const { return std::max(a.window > 0 ? pos - a.window + 1 : 0, t0) - t0; }
  int visible_hi(int pos, int t0) const { return std::min(pos + 1, t0 + TILE) - t0; }

  // Fold row r's scores of this tile (visible keys [jlo, jhi)) into its running max and sum; leaves
  // the probabilities in s.p and the rescale factor of the previous accumulator in s.alpha.
  void softmax_row(int r, int jlo, int jhi, Scratch& s) const {
    float* row = s.p.data() + size_t(r) * TILE;
    V sv[TV];
    Mask mask[TV];
    V mx = vset(kNegInf);
    for (int v = 0; v < TV; ++v) {
      sv[v] = vload(row + 16 * v);
      if (a.softcap > 0.0f) sv[v] = vtanh(sv[v]) * vset(a.softcap * kLog2e);
      mask[v] = lanes_in(jlo - 16 * v, jhi - 16 * v);
      sv[v] = vselect(mask[v], sv[v], vset(kNegInf));
      mx = vmax(mx, sv[v]);
    }
    const float m_old = s.m[r];
    const float m_new = std::max(m_old, vhmax(mx));
    float alpha = 0.0f;
    if (m_old != kNegInf) {
      alignas(64) float tmp[16];
      vstore(tmp, vexp2(vset(m_old - m_new)));
      alpha = tmp[0];
    }
    const V mv = vset(m_new);
    V sum = vzero();
    for (int v = 0; v < TV; ++v) {
      const V pv = vselect(mask[v], vexp2(sv[v] - mv), vzero());
      vstore(row + 16 * v, pv);
      sum = sum + pv;
    }
    s.l[r] = s.l[r] * alpha + vhsum(sum);
    s.m[r] = m_new;
    s.alpha[r] = alpha;
  }

  // The same fold for the 16 rows (lanes) of row vector v of a block at padded row `base`, on the
  // scores st (key j's lanes at st + j * BR) of the block's keys [jlo, jhi); each lane's visible keys
  // from its position (s.pos; padded rows see none). `full`: every row sees every key of the tile
  // (no masks). The same operations, lane by lane, as softmax_row; the tile's sum of probabilities per
  // row is vhsum's tree over its 16 lanes of (0 + p[lane]) + p[16 + lane] + ..., here a tree of
  // vectors (terms that are 0 there are left out here: adding +0 to a sum of non-negative terms is exact).
  void softmax_block(int v, int base, int t0, int jlo, int jhi, bool full, Scratch& s) const {
    float* col = s.st.data() + 16 * v;
    const V pos = vload(s.pos.data() + base), t0v = vset(float(t0));
    const V lo_v = (a.window > 0 ? vmax(pos - vset(float(a.window - 1)), t0v) : t0v) - t0v;
    const V hi_v = vmin(pos + vset(1.0f), vset(float(t0 + TILE))) - t0v;
    auto visible = [&](int j) {
      const V jv = vset(float(j));
      return full ? Mask(0xFFFF) : Mask(vlt(jv, hi_v) & ~vlt(jv, lo_v));
    };
    V mx = vset(kNegInf);
    for (int j = jlo; j < jhi; ++j) {
      float* sj = col + size_t(j) * BR;
      V sv = vload(sj);
      if (a.softcap > 0.0f) sv = vtanh(sv) * vset(a.softcap * kLog2e);
      if (!full) sv = vselect(visible(j), sv, vset(kNegInf));
      if (a.softcap > 0.0f || !full) vstore(sj, sv);
      mx = vmax(mx, sv);
    }
    const V m_old = vload(s.m.data() + base);
    const V m_new = vselect(vlt(m_old, mx), mx, m_old);  // std::max(m_old, mx), as softmax_row
    const V alpha = vselect(vlt(vset(kNegInf), m_old), vexp2(m_old - m_new), vzero());
    V u[16];
    for (int i = 0; i < 16; ++i) u[i] = vzero();
    if (full) {
      for (int t = 0; t < TV; ++t)
        for (int i = 0; i < 16; ++i) {
          float* pj = col + size_t(16 * t + i) * BR;
          const V p = vexp2(vload(pj) - m_new);
          vstore(pj, p);
          u[i] = u[i] + p;
        }
    } else {
      for (int j = jlo; j < jhi; ++j) {
        float* pj = col + size_t(j) * BR;
        vstore(pj, vselect(visible(j), vexp2(vload(pj) - m_new), vzero()));
      }
      for (int t = 0; t < TV; ++t)
        for (int i = 0; i < 16; ++i) {
          const int j = 16 * t + i;
          if (j >= jlo && j < jhi) u[i] = u[i] + vload(col + size_t(j) * BR);
        }
    }
    for (int h = 8; h >= 1; h /= 2)
      for (int i = 0; i < h; ++i) u[i] = u[i] + u[i + h];
    const Mask live = full ? Mask(0xFFFF) : vlt(lo_v, hi_v);
    const V l_old = vload(s.l.data() + base);
    vstore(s.l.data() + base, vselect(live, l_old * alpha + u[0], l_old));
    vstore(s.m.data() + base, vselect(live, m_new, m_old));
    vstore(s.alpha.data() + base, vselect(live, alpha, vset(1.0f)));  // 1: rows without keys here keep acc
  }

  // Row r of an item: head block r / nqg (KV head h0 + it), then position i0 + (r % nqg) / G, query
  // head (r % nqg) % G of the group.
  int64_t row_token(const Item& it, int qs, int nqg, int r) const { return qs + it.i0 + (r % nqg) / G; }
  int64_t row_head(const Item& it, int nqg, int r) const { return int64_t(it.h0 + r / nqg) * G + (r % nqg) % G; }

  float q_at(int64_t i) const {
    if (a.q_dtype == 0) return static_cast<const float*>(a.q)[i];
    if (a.q_dtype == 1) return to_f32(static_cast<const BF16*>(a.q)[i]);
    return to_f32(static_cast<const F16*>(a.q)[i]);
  }
  float q_mul() const { return a.softcap > 0.0f ? a.scale / a.softcap : a.scale * kLog2e; }

  // Rows' initial state: running max -inf, sum 0, accumulator 0.
  void init_rows(int rows, Scratch& s) const {
    std::fill_n(s.m.data(), rows, kNegInf);
    std::fill_n(s.l.data(), rows, 0.0f);
    std::fill_n(s.acc.data(), size_t(rows) * Dp, 0.0f);
  }

  // Row-wise path: scaled queries in s.qp [rows][Dp].
  void load_q(const Item& it, int qs, int nqg, int rows, Scratch& s) const {
    const float qmul = q_mul();
    for (int r = 0; r < rows; ++r) {
      float* dst = s.qp.data() + size_t(r) * Dp;
      const int64_t off = row_token(it, qs, nqg, r) * a.q_stride_t + row_head(it, nqg, r) * a.q_stride_h;
      for (int d = 0; d < D; ++d) dst[d] = q_at(off + d) * qmul;
      for (int d = D; d < Dp; ++d) dst[d] = 0.0f;
    }
    init_rows(rows, s);
  }

  // Blocked path: head i's rows at padded rows [i * nqp, i * nqp + nqg); block b (rows [BR b, BR b + BR))
  // transposed in s.qt at b * BR * Dp as [Dp][BR], zeros past head_dim and past the rows. Each padded
  // row's absolute position in s.ipos and s.pos (float, exact); padding rows far before position 0.
  void load_qt(const Item& it, int qs, int nqg, int nqp, int first, Scratch& s) const {
    const V qmul = vset(q_mul());
    const int heads = it.h1 - it.h0;
    for (int hi = 0; hi < heads; ++hi) {
      int p = 0, g = 0;  // row r of the head: position i0 + p, query head (h0 + hi) * G + g (no divisions)
      for (int r0 = 0; r0 < nqp; r0 += 16) {  // 16 rows (one row vector) at a time
        const int pr = hi * nqp + r0;
        int64_t off[16];
        for (int i = 0; i < 16; ++i) {
          const bool real = r0 + i < nqg;
          s.ipos[pr + i] = real ? first + p : -(1 << 20);
          s.pos[pr + i] = float(s.ipos[pr + i]);
          off[i] = real ? (qs + it.i0 + p) * a.q_stride_t + (int64_t(it.h0 + hi) * G + g) * a.q_stride_h : -1;
          if (++g == G) {
            g = 0;
            ++p;
          }
        }
        float* dst = s.qt.data() + size_t(pr / BR) * BR * Dp + pr % BR;
        for (int d0 = 0; d0 < Dp; d0 += 16) {
          V rows[16];
          for (int i = 0; i < 16; ++i)
            rows[i] = off[i] < 0 ? vzero() : load_q16(off[i] + d0, std::min(16, D - d0)) * qmul;
          transpose16(rows);
          for (int d = 0; d < 16; ++d) vstore(dst + size_t(d0 + d) * BR, rows[d]);
        }
      }
    }
    init_rows(heads * nqp, s);
  }

  // n (<= 16) query elements from element i as fp32, zeros beyond.
  V load_q16(int64_t i, int n) const {
    if (a.q_dtype == 0) return load16(static_cast<const float*>(a.q) + i, n);
    if (a.q_dtype == 1) return load16(static_cast<const BF16*>(a.q) + i, n);
    return load16(static_cast<const F16*>(a.q) + i, n);
  }

  // The lines to request while head h computes on the tile at off (keys [ks, ke); the next tile's keys
  // [ns, ne) at next_off, none past the last tile): Walk::head, the next tile's rows of head h;
  // Walk::heads, the next head's rows of this tile (after the last head, the next tile's head 0);
  // Walk::rows, none (run() planned the next tile's whole rows).
  void plan_head_prefetch(const int64_t* off, const int64_t* next_off, int ks, int ke, int ns, int ne, int h, Walk walk,
                          Scratch& s) const {
    if (walk == Walk::rows) return;
    if (walk == Walk::heads) {
      if (h + 1 < a.num_kv_heads) return plan_prefetch(off, ks, ke, h + 1, s.pf);
      h = 0;
    }
    if (ns < ne) {
      plan_prefetch(next_off, ns, ne, h, s.pf);
    } else {
      s.pf.clear();
    }
  }

  // Row-wise path: one KV head's rows [r0, r0 + n) against one tile (keys already at off). Walk::rows:
  // the next tile's whole rows are planned by the caller (flushed after the last head).
  void tile_head(const int64_t* off, const int64_t* next_off, int ns, int ne, int h, int t0, int ks, int ke, int first,
                 int r0, int n, Walk walk, Scratch& s) const {
    plan_head_prefetch(off, next_off, ks, ke, ns, ne, h, walk, s);
    const KT* krow[TILE];
    tile_rows(off, head_offset(h), ks, ke, krow, s);
    qk_rowwise_n<KT>(s.qp.data() + size_t(r0) * Dp, Dp, n, krow, ks, ke, D, s.p.data() + size_t(r0) * TILE, s.pf);
    for (int r = r0; r < r0 + n; ++r) {
      const int pos = first + (r - r0) / G;
      const int jlo = visible_lo(pos, t0), jhi = visible_hi(pos, t0);
      if (jlo >= jhi) {
        s.jlo[r] = s.jhi[r] = 0;
        continue;
      }
      s.jlo[r] = jlo;
      s.jhi[r] = jhi;
      softmax_row(r, jlo, jhi, s);
    }
    // Rows with the same visible keys share the value loads; each row's chain is the same.
    for (int r = r0; r < r0 + n;) {
      if (s.jlo[r] == s.jhi[r]) {
        ++r;
        continue;
      }
      int g = 1;
      while (g < PV_ROWS && r + g < r0 + n && s.jlo[r + g] == s.jlo[r] && s.jhi[r + g] == s.jhi[r]) ++g;
      pv_group<false>(s.acc.data() + size_t(r) * Dp, Dp, s.p.data() + size_t(r) * TILE, s.alpha.data() + r, nullptr,
                      nullptr, s.vrow.data(), s.jlo[r], s.jhi[r], D, g, false);
      r += g;
    }
    if (walk != Walk::rows || h == a.num_kv_heads - 1) s.pf.flush();
  }

  // Blocked path: one KV head's rows (nqg, from padded row p0) against one tile, block by block: scores,
  // softmax and values of a block's 32 rows while the tile's keys and values are in L1.
  void tile_blocked(const int64_t* off, const int64_t* next_off, int ns, int ne, int h, int t0, int ks, int ke,
                    int first, int p0, int nqg, Walk walk, Scratch& s) const {
    plan_head_prefetch(off, next_off, ks, ke, ns, ne, h, walk, s);
    const float* krow[TILE + KJ];
    block_rows(off, head_offset(h), ks, ke, nqg, krow, s);
    for (int r0 = 0; r0 < nqg; r0 += BR) {
      const int n = std::min(BR, nqg - r0), nv = (n + 15) / 16, pr = p0 + r0;
      // The block's keys: from its first row's window start to its last row's position.
      const int jlo = visible_lo(first + r0 / G, t0), jhi = visible_hi(first + (r0 + n - 1) / G, t0);
      if (jlo >= jhi) continue;
      // Every row sees every key of the tile: its first row the tile's last key, its last row the first.
      const bool full = jlo == 0 && jhi == TILE && visible_hi(first + r0 / G, t0) == TILE &&
                        visible_lo(first + (r0 + n - 1) / G, t0) == 0;
      qk_block(s.qt.data() + size_t(pr) * Dp, nv, krow, jlo, jhi, D, s.st.data(), s.pf);
      for (int v = 0; v < nv; ++v) softmax_block(v, pr + 16 * v, t0, jlo, jhi, full, s);
      for (int g = 0; g < n; g += PV_ROWS) {
        const int rows = std::min(PV_ROWS, n - g);
        int32_t lo[PV_ROWS], hi[PV_ROWS];
        int glo = TILE, ghi = 0;
        bool uniform = true;
        for (int r = 0; r < rows; ++r) {
          const int p = s.ipos[pr + g + r];
          lo[r] = full ? 0 : visible_lo(p, t0);
          hi[r] = full ? TILE : visible_hi(p, t0);
          uniform = uniform && lo[r] == lo[0] && hi[r] == hi[0];
          if (lo[r] < hi[r]) {
            glo = std::min(glo, lo[r]);
            ghi = std::max(ghi, hi[r]);
          }
        }
        if (glo >= ghi) continue;
        pv_group<true>(s.acc.data() + size_t(pr + g) * Dp, Dp, s.st.data() + g, s.alpha.data() + pr + g, lo, hi,
                       s.vrow.data(), glo, ghi, D, rows, !uniform);
      }
    }
    if (walk != Walk::rows || h == a.num_kv_heads - 1) s.pf.flush();
  }

  void run(const Item& it, Scratch& s) const {
    const int qs = a.query_start_loc[it.b];
    const int ctx = a.seq_lens[it.b] - (a.query_start_loc[it.b + 1] - qs);
    const int heads = it.h1 - it.h0, nqg = (it.i1 - it.i0) * G;
    // Few rows per KV head (decodes) go row-wise; more are blocked, each head's rows padded to whole blocks.
    // Items of every head read the next lines in address order: whole cache rows (token-major blocks), or
    // head by head, each head's rows of a block contiguous (head-major).
    const Walk walk = heads < a.num_kv_heads || heads == 1 ? Walk::head : whole_rows(a) ? Walk::rows : Walk::heads;
    const bool blocked = nqg > ROWWISE_MAX;
    s.pf.to_l2 = !blocked;
    const int nqp = blocked ? (nqg + BR - 1) / BR * BR : nqg;
    s.ensure(heads * nqp, Dp);
    const int first = ctx + it.i0, last = ctx + it.i1 - 1;  // absolute positions of the item's queries
    if (blocked)
      load_qt(it, qs, nqg, nqp, first, s);
    else
      load_q(it, qs, nqg, heads * nqg, s);
    const int lo = a.window > 0 ? std::max(0, first - a.window + 1) : 0;
    const int32_t* bt = a.block_tables + int64_t(it.b) * a.bt_stride;
    int64_t off[2][TILE];
    auto keys = [&](int t0) { return std::pair(std::max(t0, lo) - t0, std::min(t0 + TILE, last + 1) - t0); };
    int t0 = lo / TILE * TILE;
    {
      const auto [ks, ke] = keys(t0);
      tile_offsets(bt, t0, ks, ke, off[0]);
    }
    for (int cur = 0; t0 <= last; t0 += TILE, cur ^= 1) {
      const auto [ks, ke] = keys(t0);
      int ns = 0, ne = 0;
      if (t0 + TILE <= last) {
        std::tie(ns, ne) = keys(t0 + TILE);
        tile_offsets(bt, t0 + TILE, ns, ne, off[cur ^ 1]);
      }
      if (walk == Walk::rows && ns < ne)
        plan_prefetch_rows(off[cur ^ 1], ns, ne, s.pf);
      else if (walk == Walk::rows)
        s.pf.clear();
      for (int h = it.h0; h < it.h1; ++h) {
        if (blocked)
          tile_blocked(off[cur], off[cur ^ 1], ns, ne, h, t0, ks, ke, first, (h - it.h0) * nqp, nqg, walk, s);
        else
          tile_head(off[cur], off[cur ^ 1], ns, ne, h, t0, ks, ke, first, (h - it.h0) * nqg, nqg, walk, s);
      }
    }
    for (int hi = 0; hi < heads; ++hi)
      for (int r = 0, p = 0, g = 0; r < nqg; ++r) {  // position i0 + p, query head (h0 + hi) * G + g
        float* dst = a.out + ((qs + it.i0 + p) * int64_t(a.num_heads) + int64_t(it.h0 + hi) * G + g) * D;
        const float* src = s.acc.data() + size_t(hi * nqp + r) * Dp;
        const V l = vset(s.l[hi * nqp + r]);
        int d = 0;
        for (; d + 16 <= D; d += 16) vstore(dst + d, vload(src + d) / l);
        for (; d < D; ++d) dst[d] = src[d] / s.l[hi * nqp + r];
        if (++g == G) {
          g = 0;
          ++p;
        }
      }
  }
};

int elem_size(int dtype) { return dtype == 0 ? 4 : 2; }

// One row of `bytes`: 64-byte pieces the compiler inlines (a memcpy call per 256-byte row costs as
// much as the copy), then the rest.
inline void copy_bytes(char* dst, const char* src, int64_t bytes) {
  int64_t b = 0;
  for (; b + 64 <= bytes; b += 64) std::memcpy(dst + b, src + b, 64);
  if (b < bytes) std::memcpy(dst + b, src + b, bytes - b);
}

// The new keys and values into their slots: one copy per token and plane when a token's heads are
// contiguous in both the source (a view of one QKV projection is) and the cache (token-major blocks),
// else one per head (a memcpy call per head was ~0.4 ms of a 512-token chunk: 8192 small copies).
void write_kv(const Args& a) {
  const int64_t es = elem_size(a.kv_dtype), row = int64_t(a.head_dim) * es, hkv = a.num_kv_heads;
  const int64_t n = a.num_tokens, bs = a.block_size, sh_cache = a.kv_stride_head * es;
  const bool cache_rows = whole_rows(a);
  const int threads = n * hkv * row >= (int64_t(1) << 18) ? a.num_threads : 1;
  auto copy = [&](const void* cache, const void* src, int64_t st, int64_t sh, int64_t t) {
    const int64_t slot = a.slot_mapping[t];
    char* dst = static_cast<char*>(const_cast<void*>(cache)) +
                (slot / bs * a.kv_stride_block + slot % bs * a.kv_stride_token) * es;
    const char* from = static_cast<const char*>(src) + t * st * es;
    if (sh == a.head_dim && cache_rows) {
      std::memcpy(dst, from, hkv * row);
      return;
    }
    for (int64_t h = 0; h < hkv; ++h) copy_bytes(dst + h * sh_cache, from + h * sh * es, row);
  };
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    copy(a.k_cache, a.k_new, a.k_stride_t, a.k_stride_h, t);
    copy(a.v_cache, a.v_new, a.v_stride_t, a.v_stride_h, t);
  }
}

std::vector<Item> make_items(const Args& a) {
  std::vector<Item> items;
  // Query positions per item: as many as asked (more rows share each key tile), but halved while
  // the chunks would give fewer than 4 items per thread.
  int per = std::max(1, a.positions_per_item);
  auto chunk_items = [&](int p) {
    int64_t n = 0;
    for (int b = 0; b < a.num_seqs; ++b) {
      const int ql = a.query_start_loc[b + 1] - a.query_start_loc[b];
      if (ql > 4) n += int64_t(ql + p - 1) / p * a.num_kv_heads;
    }
    return n;
  };
  while (per > 1 && a.num_threads > 1 && chunk_items(per) < 4 * a.num_threads) per = (per + 1) / 2;
  // Decodes are bound by reading K/V: an item takes all KV heads of a sequence (whole blocks, read in
  // address order) when there are enough sequences to keep every thread busy, else one head.
  int decodes = 0;
  for (int b = 0; b < a.num_seqs; ++b) decodes += a.query_start_loc[b + 1] - a.query_start_loc[b] <= 4;
  const int decode_heads = decodes >= 4 * a.num_threads ? a.num_kv_heads : 1;
  for (int b = 0; b < a.num_seqs; ++b) {
    const int ql = a.query_start_loc[b + 1] - a.query_start_loc[b];
    const int ctx = a.seq_lens[b] - ql;
    const int heads = ql <= 4 ? decode_heads : 1;
    for (int i0 = 0; i0 < ql; i0 += per) {
      const int i1 = std::min(ql, i0 + per);
      const int lo = a.window > 0 ? std::max(0, ctx + i0 - a.window + 1) : 0;
      const int64_t cost = int64_t(i1 - i0 + 4) * (ctx + i1 - lo + TILE) * heads;
      for (int h = 0; h < a.num_kv_heads; h += heads)
        items.push_back({b, h, std::min(h + heads, a.num_kv_heads), i0, i1, cost});
    }
  }
  // Longest first, so the last item a thread picks up is a short one (the result does not depend on
  // the order: every item is computed by one thread, alone).
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}

// Per-thread buffers, kept between calls. Reached through one call per thread and call: a
// thread_local used directly in the loops costs a __tls_get_addr call per access in a shared library.
__attribute__((noinline)) Scratch& thread_scratch() {
  static thread_local Scratch s;
  return s;
}

template <class KT>
void run_items(const Args& a, const std::vector<Item>& items) {
  const Kernel<KT> k{a, a.num_heads / a.num_kv_heads, a.head_dim, round16(a.head_dim)};
  const int64_t n = int64_t(items.size());
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(a.num_threads, n)));
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    Scratch& s = thread_scratch();
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) k.run(items[i], s);
  };
  if (threads == 1) {
    work();
    return;
  }
#pragma omp parallel num_threads(threads)
  work();
}

}  // namespace

extern "C" {

const char* ladle_attention_isa() { return LADLE_ISA; }
int ladle_attention_tile() { return TILE; }

// 0 on success; a positive code for arguments the kernel does not take (the caller falls back).
int ladle_paged_attention(const Args* args) {
  const Args& a = *args;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) return 1;
  if (a.head_dim <= 0 || a.head_dim > 1024 || a.block_size <= 0) return 2;
  if (a.q_dtype < 0 || a.q_dtype > 2 || a.kv_dtype < 0 || a.kv_dtype > 2) return 3;
  if (a.k_new != nullptr) write_kv(a);
  const std::vector<Item> items = make_items(a);
  if (a.kv_dtype == 0)
    run_items<float>(a, items);
  else if (a.kv_dtype == 1)
    run_items<BF16>(a, items);
  else
    run_items<F16>(a, items);
  return 0;
}

// Args's layout, checked against its ctypes mirror (kernels/cpu_structs.py) at load.
const char* ladle_paged_layout() {
  static const std::string text = [] {
    std::string out;
    LADLE_SIZE(Args);
    LADLE_FIELD(Args, q);
    LADLE_FIELD(Args, q_stride_t);
    LADLE_FIELD(Args, q_stride_h);
    LADLE_FIELD(Args, out);
    LADLE_FIELD(Args, k_cache);
    LADLE_FIELD(Args, v_cache);
    LADLE_FIELD(Args, k_new);
    LADLE_FIELD(Args, v_new);
    LADLE_FIELD(Args, k_stride_t);
    LADLE_FIELD(Args, k_stride_h);
    LADLE_FIELD(Args, v_stride_t);
    LADLE_FIELD(Args, v_stride_h);
    LADLE_FIELD(Args, slot_mapping);
    LADLE_FIELD(Args, query_start_loc);
    LADLE_FIELD(Args, seq_lens);
    LADLE_FIELD(Args, block_tables);
    LADLE_FIELD(Args, bt_stride);
    LADLE_FIELD(Args, num_seqs);
    LADLE_FIELD(Args, num_tokens);
    LADLE_FIELD(Args, num_heads);
    LADLE_FIELD(Args, num_kv_heads);
    LADLE_FIELD(Args, head_dim);
    LADLE_FIELD(Args, block_size);
    LADLE_FIELD(Args, q_dtype);
    LADLE_FIELD(Args, kv_dtype);
    LADLE_FIELD(Args, window);
    LADLE_FIELD(Args, scale);
    LADLE_FIELD(Args, softcap);
    LADLE_FIELD(Args, num_threads);
    LADLE_FIELD(Args, positions_per_item);
    LADLE_FIELD(Args, kv_stride_block);
    LADLE_FIELD(Args, kv_stride_token);
    LADLE_FIELD(Args, kv_stride_head);
    return out;
  }();
  return text.c_str();
}

}  // extern "C"
