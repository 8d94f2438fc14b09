// The fused CPU elementwise kernels, built at first use by kernels/cpu_fused.py. Their numerical
// contract (each output rounds as the torch ops it replaces, in the same order) is described there.
// ladle fused CPU kernels, float32: residual add + RMSNorm, gated activation (SiLU / GELU-tanh times
// up), per-head RMSNorm + RoPE. Each output element is the same sequence of IEEE operations as the
// torch ops models/layers.py would run (built with -ffp-contract=off: a fused multiply-add only where
// torch's own vector code has one, GELU's inner term), and
// a row's sum of squares is added in the order torch's CPU sum kernel uses for a contiguous row.
// Rows are independent: a row's bits never depend on the other rows, the row count or the threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LADLE_FUSED_ISA "avx512"
#elif defined(__AVX2__)
#define LADLE_FUSED_ISA "avx2"
#else
#define LADLE_FUSED_ISA "generic"
#endif

namespace {

constexpr int64_t GRAIN = 32768;    // elements per call below which one thread does it all (torch's grain)
constexpr int CHUNK = 4096;         // libm activation elements per step (a stack buffer; whole rows are fastest)
constexpr int64_t MAX_HEAD = 1024;  // head_dim bound of the norm + RoPE kernel (its stack buffer)

// ---------------------------------------------------------------- exp / tanh
// torch's vectorised float exp and tanh are SLEEF's u10 functions (Vectorized<float>::exp / tanh);
// kernels/cpu_fused.py passes their addresses from torch's own library, so these round as torch does.
// Without them: libm, within an ulp of them.
#if defined(__AVX512F__)
using Fn16 = __m512 (*)(__m512);
Fn16 g_exp16 = nullptr, g_tanh16 = nullptr;
#endif
#if defined(__AVX2__)
using Fn8 = __m256 (*)(__m256);
Fn8 g_exp8 = nullptr, g_tanh8 = nullptr;
#endif

// buf[i] = exp(buf[i]) or tanh(buf[i]) for i < n, through libm (when SLEEF was not found).
void map_inplace(float* buf, int n, bool tanh_not_exp) {
  if (tanh_not_exp) {
    for (int i = 0; i < n; ++i) buf[i] = std::tanh(buf[i]);
  } else {
    for (int i = 0; i < n; ++i) buf[i] = std::exp(buf[i]);
  }
}

// ---------------------------------------------------------------- torch's row sum order
// at::sum over a contiguous last dimension of n floats, with W-lane vectors (W = 8: torch's AVX2 sum
// kernel, which its AVX512 builds also run; 16 for a torch that registers an AVX512 one): n / W vectors
// are summed by a 4-way, 4-level cascade (16 at a time per level), the cascade's four partial vectors
// added in order; then a scalar accumulator takes the n % W tail elements and the W lanes, in order.
// n < W: the same cascade over scalars. Every add starts from 0.
template <int W>
struct Lanes {
  typedef float Vec __attribute__((vector_size(W * sizeof(float))));  // lane-wise ops, one register
  Vec v;
  void zero() { v = Vec{}; }
  void add(const Lanes& o) { v += o.v; }
  static Lanes squares(const float* p) {
    Lanes s;
    std::memcpy(&s.v, p, sizeof(Vec));
    s.v = s.v * s.v;
    return s;
  }
};

inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(uint64_t(x - 1));
}

// Four interleaved running sums over `size` groups of four items (load(i, k): item k of group i), as
// torch's multi_row_sum.
template <typename T, typename Load>
__attribute__((always_inline)) inline void cascade4(int64_t size, Load load, T out[4]) {
  constexpr int levels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / levels);
  const int64_t step = int64_t(1) << power;
  T acc[levels][4];
  for (auto& level : acc)
    for (auto& a : level) a.zero();
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k].add(load(i, k));
    for (int j = 1; j < levels; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k].add(acc[j - 1][k]);
        acc[j - 1][k].zero();
      }
      if ((i & ((step - 1) << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k].add(load(i, k));
  for (int j = 1; j < levels; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k].add(acc[j][k]);
  for (int k = 0; k < 4; ++k) out[k] = acc[0][k];
}

// The 4-way row sum of `size` items: cascade over size / 4 groups, the tail items into sum 0, then
// the four sums in order.
template <typename T, typename Load>
__attribute__((always_inline)) inline T row_sum4(int64_t size, Load load) {
  T part[4];
  const int64_t groups = size / 4;
  cascade4<T>(groups, [&](int64_t i, int k) { return load(4 * i + k); }, part);
  for (int64_t i = groups * 4; i < size; ++i) part[0].add(load(i));
  for (int k = 1; k < 4; ++k) part[0].add(part[k]);
  return part[0];
}

struct Scalar {
  float v;
  void zero() { v = 0.0f; }
  void add(const Scalar& o) { v += o.v; }
};

// sum of sq[i] = x[i] * x[i] (each rounded, as x.pow(2) is) in torch's order.
template <int W>
__attribute__((always_inline)) inline float sum_squares_w(const float* x, int64_t n) {
  if (n < W) {
    return row_sum4<Scalar>(n, [&](int64_t i) { return Scalar{x[i] * x[i]}; }).v;
  }
  const int64_t nvec = n / W;
  const Lanes<W> vec = row_sum4<Lanes<W>>(nvec, [&](int64_t i) { return Lanes<W>::squares(x + i * W); });
  float total = 0.0f;
  for (int64_t i = nvec * W; i < n; ++i) total += x[i] * x[i];
  for (int l = 0; l < W; ++l) total += vec.v[l];
  return total;
}

inline float sum_squares(const float* x, int64_t n, int lanes) {
  return lanes == 16 ? sum_squares_w<16>(x, n) : sum_squares_w<8>(x, n);
}

// torch: x * rsqrt(x.pow(2).mean(-1) + eps), mean = sum / n, rsqrt = 1 / sqrt.
inline float inv_rms(const float* x, int64_t n, float eps, int lanes) {
  const float mean = sum_squares(x, n, lanes) / float(n);
  return 1.0f / std::sqrt(mean + eps);
}

#include "gated_avx512.h"

// One row of act(g) * u, n elements. With SLEEF installed: one pass in vectors (a masked or padded
// tail: every lane the same operations); otherwise chunks through libm.
void gated_row(const float* g, const float* u, float* o, int64_t n, int act) {
#if defined(__AVX512F__)
  if (Fn16 f = act == 0 ? g_exp16 : g_tanh16) {
    gated_avx512(g, u, o, n, act, f);
    return;
  }
#endif
#if defined(__AVX2__)
  if (Fn8 f = act == 0 ? g_exp8 : g_tanh8) {
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
    const __m256 beta = _mm256_set1_ps(kBeta), kappa = _mm256_set1_ps(kKappa);
    for (int64_t i = 0; i < n; i += 8) {
      const int k = int(std::min<int64_t>(8, n - i));
      alignas(32) float gx[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ux[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const float* gp = g + i;
      const float* up = u + i;
      if (k < 8) {
        std::memcpy(gx, gp, sizeof(float) * k);
        std::memcpy(ux, up, sizeof(float) * k);
        gp = gx;
        up = ux;
      }
      const __m256 x = _mm256_loadu_ps(gp);
      __m256 y;
      if (act == 0) {
        y = _mm256_div_ps(x, _mm256_add_ps(one, f(_mm256_xor_ps(x, sign))));
      } else {
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 t = f(_mm256_mul_ps(beta, _mm256_fmadd_ps(kappa, cube, x)));
        y = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t));
      }
      y = _mm256_mul_ps(y, _mm256_loadu_ps(up));
      if (k == 8) {
        _mm256_storeu_ps(o + i, y);
      } else {
        _mm256_store_ps(gx, y);
        std::memcpy(o + i, gx, sizeof(float) * k);
      }
    }
    return;
  }
#endif
  alignas(64) float buf[CHUNK];
  for (int64_t c = 0; c < n; c += CHUNK) {
    const int k = int(std::min<int64_t>(CHUNK, n - c));
    const float* gc = g + c;
    if (act == 0) {
      for (int i = 0; i < k; ++i) buf[i] = -gc[i];
      map_inplace(buf, k, false);
      for (int i = 0; i < k; ++i) o[c + i] = (gc[i] / (1.0f + buf[i])) * u[c + i];
    } else {
      for (int i = 0; i < k; ++i) buf[i] = kBeta * std::fma(kKappa, gc[i] * gc[i] * gc[i], gc[i]);
      map_inplace(buf, k, true);
      for (int i = 0; i < k; ++i) o[c + i] = ((0.5f * gc[i]) * (1.0f + buf[i])) * u[c + i];
    }
  }
}

inline int threads_for(int threads, int64_t items, int64_t elements) {
  if (elements < GRAIN) return 1;
  return int(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
}

}  // namespace

extern "C" {

const char* ladle_fused_isa() { return LADLE_FUSED_ISA; }

// Which vector widths' exp/tanh this build can call: 512 and/or 256 bits (a bit mask: 2 = 512, 1 = 256).
int ladle_fused_vector_widths() {
  int w = 0;
#if defined(__AVX512F__)
  w |= 2;
#endif
#if defined(__AVX2__)
  w |= 1;
#endif
  return w;
}

// Install torch's SLEEF exp/tanh (nullptr: libm). Returns the width now in use: 16, 8 or 0 (libm).
int ladle_fused_set_math(void* exp16, void* tanh16, void* exp8, void* tanh8) {
  int width = 0;
#if defined(__AVX2__)
  g_exp8 = nullptr;
  g_tanh8 = nullptr;
#endif
#if defined(__AVX512F__)
  g_exp16 = reinterpret_cast<Fn16>(exp16);
  g_tanh16 = reinterpret_cast<Fn16>(tanh16);
  if (g_exp16 && g_tanh16) return 16;
  g_exp16 = g_tanh16 = nullptr;
#else
  (void)exp16;
  (void)tanh16;
#endif
#if defined(__AVX2__)
  g_exp8 = reinterpret_cast<Fn8>(exp8);
  g_tanh8 = reinterpret_cast<Fn8>(tanh8);
  if (g_exp8 && g_tanh8) return 8;
  g_exp8 = g_tanh8 = nullptr;
#else
  (void)exp8;
  (void)tanh8;
#endif
  return width;
}

// The sum of squares of x[0..n) in torch's order at `lanes` lanes (kernels/cpu_fused.py calibrates).
float ladle_fused_sum_squares(const float* x, int64_t n, int lanes) { return sum_squares(x, n, lanes); }

// sum = x + residual (residual may be null: then x is normed and sum not written);
// out = weight * (sum * inv_rms(sum)), weight being the norm's weight or Gemma's (1 + weight).
int ladle_add_rmsnorm(const float* x, int64_t x_stride, const float* res, int64_t res_stride, float* sum,
                      int64_t sum_stride, float* out, int64_t out_stride, const float* weight, int64_t rows,
                      int64_t dim, float eps, int lanes, int threads) {
  if (dim <= 0 || rows < 0 || (lanes != 8 && lanes != 16)) return 1;
  const int nt = threads_for(threads, rows, rows * dim);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    const float* s = xr;
    if (res != nullptr) {
      const float* rr = res + r * res_stride;
      float* sr = sum + r * sum_stride;
      for (int64_t i = 0; i < dim; ++i) sr[i] = xr[i] + rr[i];
      s = sr;
    }
    const float inv = inv_rms(s, dim, eps, lanes);
    float* o = out + r * out_stride;
    for (int64_t i = 0; i < dim; ++i) o[i] = weight[i] * (s[i] * inv);
  }
  return 0;
}

// out[r, i] = act(gate_up[r, i]) * gate_up[r, width + i]; act 0: SiLU x / (1 + exp(-x)),
// 1: GELU-tanh 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as torch's vectorised kernels (whose
// compiler contracts x + 0.044715 x^3 into one fused multiply-add: so does this, explicitly).
int ladle_gated_act(const float* gate_up, int64_t in_stride, float* out, int64_t out_stride, int64_t rows,
                    int64_t width, int act, int threads) {
  if (width <= 0 || rows < 0 || act < 0 || act > 1) return 1;
  const int nt = threads_for(threads, rows, rows * width);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * in_stride;
    gated_row(g, g + width, out + r * out_stride, width, act);
  }
  return 0;
}

// For each row t and head h of x [rows, heads, dim] (strides x_row, x_head; last dim contiguous):
// y = x, or weight[h] * (x * inv_rms(x)) when weight [heads, dim] is given; then RoPE with the full
// width tables of row t: out = y * cos + roll(y, dim / 2) * sin (sin carries rotate_half's sign).
// out is [rows, heads, dim] contiguous.
int ladle_qk_norm_rope(const float* x, int64_t x_row, int64_t x_head, float* out, const float* weight, const float* cos,
                       int64_t cos_row, const float* sin, int64_t sin_row, int64_t rows, int64_t heads, int64_t dim,
                       float eps, int lanes, int threads) {
  if (dim <= 0 || dim > MAX_HEAD || rows < 0 || heads <= 0 || (lanes != 8 && lanes != 16)) return 1;
  const int64_t items = rows * heads, half = dim / 2;
  const int nt = threads_for(threads, items, items * dim);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t t = item / heads, h = item % heads;
    const float* xh = x + t * x_row + h * x_head;
    const float* c = cos + t * cos_row;
    const float* s = sin + t * sin_row;
    float* o = out + item * dim;
    alignas(64) float y[MAX_HEAD];
    if (weight != nullptr) {
      const float inv = inv_rms(xh, dim, eps, lanes);
      const float* w = weight + h * dim;
      for (int64_t i = 0; i < dim; ++i) y[i] = w[i] * (xh[i] * inv);
    } else {
      std::memcpy(y, xh, sizeof(float) * dim);
    }
    // roll(y, half)[i] = y[(i + half) % dim]
    const int64_t split = dim - half;
    for (int64_t i = 0; i < split; ++i) o[i] = y[i] * c[i] + y[i + half] * s[i];
    for (int64_t i = split; i < dim; ++i) o[i] = y[i] * c[i] + y[i - split] * s[i];
  }
  return 0;
}

}  // extern "C"
