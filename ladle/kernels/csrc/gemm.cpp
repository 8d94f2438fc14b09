// The CPU float32 GEMM, built at first use by kernels/cpu_gemm.py. Its numerical contract (the same
// K-blocked chains as oneDNN's, so the same bits) is described in kernels/cpu_gemm.py.
// ladle CPU GEMM, float32, AVX-512: out[M][N] = x[M][K] @ W[N][K]^T, W packed once into column
// groups of 32 ([group][k][32]: one k step of a group is two consecutive cache lines). Every output is
// one fused multiply-add chain per K block of KB, in increasing k from +0, the blocks' partial sums
// added left to right: a function of its own row and column alone, never of M, the other rows or
// the threads. The weight stream is prefetched ahead (PF_L2 bytes into L2, PF_L1 into L1) by the first
// row chunk of each K block, the one that reads it from DRAM: without it a few-row GEMM costs the
// weight's DRAM time plus its compute time instead of the larger of the two.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Two distances: into L2 far ahead (prefetcht1: the DRAM latency), into L1 near (prefetcht0: L2's).
// Measured on a Zen 4 EPYC against one request into L1 8 KiB ahead from every row chunk (the whole
// 166M model's weights from DRAM, 1 thread): 1.06x / 1.30x / 1.02x faster at 1 / 8 / 32 rows, the same at
// 512 (2 threads: 1.01x / 1.06x / 1.035x / 1.00x). Into L1 only, the few-row stream likely holds the core's
// L1 miss slots (no hardware counters on this VM to show it); from every chunk, the later chunks (whose
// slice is in L2 already) pay the instructions at 512 rows (-1%).
#ifndef LADLE_GEMM_PF_L2
#define LADLE_GEMM_PF_L2 16384
#endif
#ifndef LADLE_GEMM_PF_L1
#define LADLE_GEMM_PF_L1 4096
#endif

namespace {
constexpr int GW = 32;  // columns per group: two 16-lane vectors
constexpr int MR = 12;  // rows per micro-kernel: 12 x 2 accumulators, 2 weight vectors, 1 broadcast
// Rows packed at a time, at most: a 512-row chunk is one slab, one pass over the weight (at 240 rows
// it was 240 + 240 + 32, three passes, the last for 32 rows; one pass: the 166M model's run 1-2%
// faster end to end, docs/design-notes.md). Larger M is split into equal slabs.
constexpr int SLAB = 43 * MR;

int64_t groups_of(int n) { return (int64_t(n) + GW - 1) / GW; }

#if defined(__AVX512F__)
// R rows (xp: [k][MR], the rows' k-th elements together) x one group's 32 columns (p: [k][32]) over
// the inputs k in [k0, k1); the first block stores, later ones add their partial sums to out. PF: request
// the weight's coming lines (the first row chunk of a K block; the others find them in L2).
template <int R, bool PF>
__attribute__((always_inline)) inline void micro(const float* xp, const float* p, int k0, int k1, float* out,
                                                 int64_t ldo, bool first, int cols) {
  __m512 acc[R][2];
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const float* pk = p + int64_t(k0) * GW;
  const float* xk = xp + int64_t(k0) * MR;
  for (int k = k0; k < k1; ++k, pk += GW, xk += MR) {
    const __m512 b0 = _mm512_loadu_ps(pk), b1 = _mm512_loadu_ps(pk + 16);
    if constexpr (PF) {
      const char* line = reinterpret_cast<const char*>(pk);
      _mm_prefetch(line + LADLE_GEMM_PF_L2, _MM_HINT_T1);
      _mm_prefetch(line + LADLE_GEMM_PF_L2 + 64, _MM_HINT_T1);
      _mm_prefetch(line + LADLE_GEMM_PF_L1, _MM_HINT_T0);
      _mm_prefetch(line + LADLE_GEMM_PF_L1 + 64, _MM_HINT_T0);
    }
    for (int m = 0; m < R; ++m) {
      const __m512 a = _mm512_set1_ps(xk[m]);
      acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : __mmask16((1u << cols) - 1u);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : __mmask16((1u << (cols - 16)) - 1u);
  for (int m = 0; m < R; ++m) {
    float* o = out + m * ldo;
    __m512 v0 = acc[m][0], v1 = acc[m][1];
    if (!first) {
      v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), v0);
      v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + 16), v1);
    }
    _mm512_mask_storeu_ps(o, m0, v0);
    _mm512_mask_storeu_ps(o + 16, m1, v1);
  }
}

__attribute__((always_inline)) inline void micro_rows(int r, const float* xp, const float* p, int k0, int k1,
                                                      float* out, int64_t ldo, bool first, int cols, bool pf) {
  switch (r) {
    // clang-format off: one case per row count, as a table
#define LADLE_ROWS(R)                                                        \
  case R:                                                                    \
    return pf ? micro<R, true>(xp, p, k0, k1, out, ldo, first, cols)        \
              : micro<R, false>(xp, p, k0, k1, out, ldo, first, cols);
    LADLE_ROWS(1) LADLE_ROWS(2) LADLE_ROWS(3) LADLE_ROWS(4) LADLE_ROWS(5) LADLE_ROWS(6)
    LADLE_ROWS(7) LADLE_ROWS(8) LADLE_ROWS(9) LADLE_ROWS(10) LADLE_ROWS(11) default: LADLE_ROWS(12)
#undef LADLE_ROWS
    // clang-format on
  }
}

// rows x [rows][kn] (rows ldx apart) into dst as [kn][MR] (the micro-kernel's broadcasts then read
// consecutive floats: rows K floats apart fall in the same L1 sets).
// Four rows at a time go through 4 x 4 transposes (a quarter of the stores of an element-wise copy:
// 5% of a 512-row GEMM's time that way).
void pack_block(const float* x, int64_t ldx, int rows, int kn, float* dst) {
  int m = 0;
  for (; m + 4 <= rows; m += 4) {
    const float* r0 = x + int64_t(m) * ldx;
    const float *r1 = r0 + ldx, *r2 = r1 + ldx, *r3 = r2 + ldx;
    int k = 0;
    for (; k + 4 <= kn; k += 4) {
      __m128 a = _mm_loadu_ps(r0 + k), b = _mm_loadu_ps(r1 + k), c2 = _mm_loadu_ps(r2 + k), d = _mm_loadu_ps(r3 + k);
      _MM_TRANSPOSE4_PS(a, b, c2, d);
      float* o = dst + int64_t(k) * MR + m;
      _mm_storeu_ps(o, a);
      _mm_storeu_ps(o + MR, b);
      _mm_storeu_ps(o + 2 * MR, c2);
      _mm_storeu_ps(o + 3 * MR, d);
    }
    for (; k < kn; ++k)
      for (int i = 0; i < 4; ++i) dst[int64_t(k) * MR + m + i] = x[int64_t(m + i) * ldx + k];
  }
  for (; m < rows; ++m) {
    const float* src = x + int64_t(m) * ldx;
    for (int k = 0; k < kn; ++k) dst[int64_t(k) * MR + m] = src[k];
  }
}

// Rows [MR c, MR c + MR) of x into xb's chunk c as [K][MR].
void pack_rows(const float* x, int64_t ldx, int M, int K, int c, float* xb) {
  const int m0 = c * MR;
  pack_block(x + int64_t(m0) * ldx, ldx, std::min(MR, M - m0), K, xb + int64_t(c) * K * MR);
}

// The gated activation fused into the packing (the down projection of a gated MLP): row r of the
// GEMM's input is act(g) * u with g = x[r][0, K) and u = x[r][K, 2K), computed a piece of KP columns
// at a time into an L1 buffer, then packed from there. Every element goes through the very operations
// of kernels/cpu_fused's gated_row (torch's SLEEF exp / tanh, 16 lanes, lane by lane), so the packed
// values, and the GEMM's outputs, are bitwise those of the activation kernel followed by this GEMM;
// the activation's [M, K] output is never written to memory and read back.
using Fn16 = __m512 (*)(__m512);
Fn16 g_exp16 = nullptr, g_tanh16 = nullptr;
constexpr int KP = 256;
#include "gated_avx512.h"

void gated_piece(const float* g, const float* u, float* o, int n, int act) {
  gated_avx512(g, u, o, n, act, act == 0 ? g_exp16 : g_tanh16);
}

void pack_rows_gated(const float* x, int64_t ldx, int M, int K, int c, float* xb, int act) {
  alignas(64) float buf[MR * KP];
  const int m0 = c * MR, rows = std::min(MR, M - m0);
  float* dst = xb + int64_t(c) * K * MR;
  for (int k0 = 0; k0 < K; k0 += KP) {
    const int kn = std::min(KP, K - k0);
    for (int m = 0; m < rows; ++m) {
      const float* g = x + int64_t(m0 + m) * ldx + k0;
      gated_piece(g, g + K, buf + m * KP, kn, act);
    }
    pack_block(buf, KP, rows, kn, dst + int64_t(k0) * MR);
  }
}

// One column group, every row chunk, block by block (a block's slice of the group stays in L2
// while the row chunks pass over it).
void group(const float* xb, const float* p, float* out, int64_t ldo, int M, int N, int K, int kb, int64_t g) {
  const float* pg = p + g * K * GW;
  const int cols = int(std::min<int64_t>(GW, N - g * GW));
  for (int k0 = 0; k0 < K; k0 += kb) {
    const int k1 = std::min(K, k0 + kb);
    for (int m0 = 0; m0 < M; m0 += MR)
      micro_rows(std::min(MR, M - m0), xb + int64_t(m0) * K, pg, k0, k1, out + m0 * ldo + g * GW, ldo, k0 == 0, cols,
                 m0 == 0);
  }
}
#endif

// A thread's share of the column groups, [front, end) in one word: its owner takes groups from the
// front (one forward stream through the packed weight); a thread done with its own share takes the
// back group of the share with the most left. With fixed shares the 2-thread GEMM waited on the slower
// core: 6-12% apart on the larger weights at one moment here, 2% at another (vCPUs run at varying speed).
struct alignas(64) Share {
  std::atomic<uint64_t> word{0};
  void set(int64_t f, int64_t e) { word.store(uint64_t(f) | uint64_t(e) << 32, std::memory_order_relaxed); }
  int64_t left() const {
    const uint64_t v = word.load(std::memory_order_relaxed);
    return int64_t(v >> 32) - int64_t(v & 0xFFFFFFFFu);
  }
  // The front group (front = true) or the back one; -1 when none is left.
  int64_t take(bool front) {
    uint64_t v = word.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = int64_t(v & 0xFFFFFFFFu), e = int64_t(v >> 32);
      if (f >= e) return -1;
      const uint64_t next = front ? uint64_t(f + 1) | uint64_t(e) << 32 : uint64_t(f) | uint64_t(e - 1) << 32;
      if (word.compare_exchange_weak(v, next, std::memory_order_relaxed)) return front ? f : e - 1;
    }
  }
};

#if defined(__AVX512F__)
// Thread t of nt: its own share of the groups first, then the back groups of the others'.
void groups_shared(Share* shares, int t, int nt, const float* xb, const float* p, float* out, int64_t ldo, int M, int N,
                   int K, int kb) {
  for (int64_t g = shares[t].take(true); g >= 0; g = shares[t].take(true)) group(xb, p, out, ldo, M, N, K, kb, g);
  for (;;) {
    int victim = -1;
    int64_t most = 0;
    for (int v = 0; v < nt; ++v)
      if (v != t && shares[v].left() > most) most = shares[v].left(), victim = v;
    if (victim < 0) return;
    const int64_t g = shares[victim].take(false);
    if (g >= 0) group(xb, p, out, ldo, M, N, K, kb, g);
  }
}
#endif
}  // namespace

extern "C" {

const char* ladle_gemm_isa() {
#if defined(__AVX512F__)
  return "avx512";
#else
  return "none";
#endif
}

int64_t ladle_gemm_packed_numel(int n, int k) { return groups_of(n) * k * GW; }

// W [N][K] (rows ldw apart) into p [groups][K][32], zeros past N.
int ladle_gemm_pack(const float* w, int64_t ldw, float* p, int n, int k) {
  if (n <= 0 || k <= 0) return 1;
  for (int64_t g = 0; g < groups_of(n); ++g)
    for (int kk = 0; kk < k; ++kk)
      for (int l = 0; l < GW; ++l) {
        const int64_t col = g * GW + l;
        p[(g * k + kk) * GW + l] = col < n ? w[col * ldw + kk] : 0.0f;
      }
  return 0;
}

// out [M][N] (rows ldo apart) = x [M][K] (rows ldx apart) @ W^T, K blocks of kb; 0 on success.
// act >= 0: the gated form (ladle_gemm_gated), x [M][2K] is gate|up and the GEMM's input act(gate) * up.
static int run(const float* x, int64_t ldx, const float* p, float* out, int64_t ldo, int m, int n, int k, int kb,
               int threads, int act) {
#if defined(__AVX512F__)
  if (m < 0 || n <= 0 || k <= 0 || kb <= 0) return 1;
  if (act >= 0 && (act > 1 || (act == 0 ? g_exp16 : g_tanh16) == nullptr)) return 3;
  if (m == 0) return 0;
  // Rows go in equal slabs of at most SLAB: the packed rows stay bounded (SLAB x K floats, 6 MB at
  // K = 3072), and no small leftover slab pays a whole pass over the weight for a few rows.
  const int nslabs = (m + SLAB - 1) / SLAB;
  const int slab_chunks = ((m + nslabs - 1) / nslabs + MR - 1) / MR, slab = slab_chunks * MR;
  static thread_local std::vector<float> xbuf;  // the caller's thread owns it; the team fills it
  if (xbuf.size() < size_t(slab_chunks) * k * MR) xbuf.resize(size_t(slab_chunks) * k * MR);
  float* xb = xbuf.data();
  const int64_t ng = groups_of(n);
  const int team = int(std::min<int64_t>(std::max(threads, 1), ng));
  std::unique_ptr<Share[]> shares(new Share[team]);
#pragma omp parallel num_threads(team) if (team > 1)
  {
#ifdef _OPENMP
    // nt may be below team (OMP_THREAD_LIMIT, OMP_DYNAMIC, a nested call): the groups go to those that run.
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
    for (int s0 = 0; s0 < m; s0 += slab) {
      const int rows = std::min(slab, m - s0), chunks = (rows + MR - 1) / MR;
      shares[t].set(ng * t / nt, ng * (t + 1) / nt);  // published by the packing's barrier
      if (act < 0) {
#pragma omp for schedule(static)
        for (int c = 0; c < chunks; ++c) pack_rows(x + s0 * ldx, ldx, rows, k, c, xb);
      } else {
#pragma omp for schedule(static)
        for (int c = 0; c < chunks; ++c) pack_rows_gated(x + s0 * ldx, ldx, rows, k, c, xb, act);
      }
      groups_shared(shares.get(), t, nt, xb, p, out + s0 * ldo, ldo, rows, n, k, kb);
      if (s0 + slab < m) {  // the next slab's packing overwrites xb (the region's end waits after the last)
#pragma omp barrier
      }
    }
  }
  return 0;
#else
  (void)x;
  (void)ldx;
  (void)p;
  (void)out;
  (void)ldo;
  (void)m;
  (void)n;
  (void)k;
  (void)kb;
  (void)threads;
  (void)act;
  return 2;  // no AVX-512: the caller keeps oneDNN
#endif
}

int ladle_gemm(const float* x, int64_t ldx, const float* p, float* out, int64_t ldo, int m, int n, int k, int kb,
               int threads) {
  return run(x, ldx, p, out, ldo, m, n, k, kb, threads, -1);
}

// out [M][N] = (act(x[:, :K]) * x[:, K:2K]) @ W^T for x [M][2K] (gate | up, rows ldx apart); act 0 SiLU,
// 1 GELU-tanh, computed as kernels/cpu_fused's gated activation computes them (needs ladle_gemm_set_math).
int ladle_gemm_gated(const float* x, int64_t ldx, const float* p, float* out, int64_t ldo, int m, int n, int k, int kb,
                     int threads, int act) {
  if (act < 0) return 1;
  return run(x, ldx, p, out, ldo, m, n, k, kb, threads, act);
}

// torch's 16-lane SLEEF exp and tanh (the fused kernels' own), for the gated form; 1 when installed.
int ladle_gemm_set_math(void* exp16, void* tanh16) {
#if defined(__AVX512F__)
  g_exp16 = reinterpret_cast<Fn16>(exp16);
  g_tanh16 = reinterpret_cast<Fn16>(tanh16);
  return g_exp16 != nullptr && g_tanh16 != nullptr;
#else
  (void)exp16;
  (void)tanh16;
  return 0;
#endif
}

}  // extern "C"
