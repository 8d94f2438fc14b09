// The CPU decoder-layer stack, built at first use by kernels/cpu_layers.py. It computes nothing itself:
// it calls the kernels of fused.cpp, gemm.cpp and paged_attention.cpp through function pointers handed
// over from their loaded libraries, with the very arguments their Python wrappers pass.
// ladle CPU decoder-layer stack: the layers of a Llama / Qwen3 forward (all but the last) as one call.
// Per layer, in the order models/llama.LlamaDecoderLayer runs them:
//   h, res = add_rms_norm(x, res)       (layer 0 with no residual: h = rms_norm(x), res = x)
//   qkv = h @ Wqkv^T;  q|k = qk_norm_rope(qkv[:, :q+k]);  v = qkv[:, q+k:]
//   attn = paged_attention(q, k, v)     (the kernel writes k and v into this layer's cache first)
//   o = attn @ Wo^T;  h, res = add_rms_norm(o, res);  gate_up = h @ Wgu^T
//   x = (act(gate) * up) @ Wdown^T      (the gated GEMM: the activation inside its row packing)
// Between two kernels there is no Python and no torch op: on a shared vCPU the first torch op after a
// long kernel cost ~70 us (its code and data gone cold), ~1 ms per layer of a 512-token step here.
#include <cstdint>
#include <string>

#include "layout.h"

extern "C" {
typedef int (*AddRmsNormFn)(const float*, int64_t, const float*, int64_t, float*, int64_t, float*, int64_t,
                            const float*, int64_t, int64_t, float, int, int);
typedef int (*GemmFn)(const float*, int64_t, const float*, float*, int64_t, int, int, int, int, int);
typedef int (*GemmGatedFn)(const float*, int64_t, const float*, float*, int64_t, int, int, int, int, int, int);
typedef int (*QkNormRopeFn)(const float*, int64_t, int64_t, float*, const float*, const float*, int64_t, const float*,
                            int64_t, int64_t, int64_t, int64_t, float, int, int);
typedef int (*AttentionFn)(const void*);

// Mirrored by kernels/cpu_structs.StackOps (as are the structs below).
struct StackOps {
  AddRmsNormFn add_rmsnorm;
  GemmFn gemm;
  GemmGatedFn gemm_gated;
  QkNormRopeFn qk_norm_rope;
  AttentionFn attention;
};

// A packed weight (kernels/cpu_gemm.PackedWeight): n outputs, k inputs, K blocks of kb.
struct StackLinear {
  const float* packed;
  int32_t n, k, kb;
};

// One layer's weights and KV cache planes.
struct StackLayer {
  const float* input_norm;
  const float* post_norm;
  const float* qk_norm;  // [q heads + kv heads, head_dim], or null (no q/k norm)
  StackLinear qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
};

// The forward's rows, sizes and buffers (shared by every layer).
struct StackStep {
  int64_t rows;
  int32_t hidden, q_heads, kv_heads, head_dim, act, lanes, threads;
  float eps, qk_eps;
  const float* cos;  // [rows, head_dim] rows cos_row apart (signed sin likewise)
  const float* sin;
  int64_t cos_row, sin_row;
  const float* input;    // [rows, hidden]: the first layer's input (the embedding), only read
  float* x;              // [rows, hidden]: each layer's MLP output, the next one's input
  float* residual;       // [rows, hidden]: the residual stream on return
  float* h;              // [rows, hidden]: normed rows
  float* qkv;            // [rows, (q + 2 kv) head_dim]
  float* qk;             // [rows, q + kv heads, head_dim]: normed, rotated
  float* attn;           // [rows, q heads, head_dim]
  float* o;              // [rows, hidden]
  float* gate_up;        // [rows, 2 intermediate]
  void* attention_args;  // the attention kernel's Args, every field but the cache planes filled
  void** args_k_cache;   // that struct's k_cache and v_cache fields
  void** args_v_cache;
};

// 0 on success; else 1000 (layer + 1) + the step whose kernel refused its arguments (1-8, in the order
// above), which kernels/cpu_layers.run names.
int ladle_stack_run(const StackOps* ops, const StackStep* s, const StackLayer* layers, int n_layers) {
  const int64_t t = s->rows;
  const int hidden = s->hidden, d = s->head_dim;
  const int qkv_width = (s->q_heads + 2 * s->kv_heads) * d, qk_heads = s->q_heads + s->kv_heads;
  const int m = int(t);
  const float* in = s->input;
  const float* res = nullptr;  // the first layer norms its input alone, which then is the residual stream
  for (int i = 0; i < n_layers; ++i) {
    const StackLayer& L = layers[i];
    const int fail = 1000 * (i + 1);
    // Layer 0: no residual yet, so no sum is written (the kernel ignores `sum` then) and the input is the stream.
    if (ops->add_rmsnorm(in, hidden, res, hidden, s->residual, hidden, s->h, hidden, L.input_norm, t, hidden, s->eps,
                         s->lanes, s->threads) != 0)
      return fail + 1;
    const float* stream = res != nullptr ? s->residual : in;
    if (ops->gemm(s->h, hidden, L.qkv.packed, s->qkv, L.qkv.n, m, L.qkv.n, L.qkv.k, L.qkv.kb, s->threads) != 0)
      return fail + 2;
    if (ops->qk_norm_rope(s->qkv, qkv_width, d, s->qk, L.qk_norm, s->cos, s->cos_row, s->sin, s->sin_row, t, qk_heads,
                          d, L.qk_norm != nullptr ? s->qk_eps : 0.0f, s->lanes, s->threads) != 0)
      return fail + 3;
    *s->args_k_cache = L.k_cache;
    *s->args_v_cache = L.v_cache;
    if (ops->attention(s->attention_args) != 0) return fail + 4;
    const int attn_width = s->q_heads * d;
    if (ops->gemm(s->attn, attn_width, L.o.packed, s->o, L.o.n, m, L.o.n, L.o.k, L.o.kb, s->threads) != 0)
      return fail + 5;
    // The residual stream lives in s->residual from here on (in place: each element is read, then
    // written, by the same lane).
    if (ops->add_rmsnorm(s->o, hidden, stream, hidden, s->residual, hidden, s->h, hidden, L.post_norm, t, hidden,
                         s->eps, s->lanes, s->threads) != 0)
      return fail + 6;
    res = s->residual;
    if (ops->gemm(s->h, hidden, L.gate_up.packed, s->gate_up, L.gate_up.n, m, L.gate_up.n, L.gate_up.k, L.gate_up.kb,
                  s->threads) != 0)
      return fail + 7;
    if (ops->gemm_gated(s->gate_up, 2 * L.down.k, L.down.packed, s->x, L.down.n, m, L.down.n, L.down.k, L.down.kb,
                        s->threads, s->act) != 0)
      return fail + 8;
    in = s->x;
  }
  return 0;
}

// The stack structs's layout, checked against its ctypes mirror (kernels/cpu_structs.py) at load.
const char* ladle_stack_layout() {
  static const std::string text = [] {
    std::string out;
    LADLE_SIZE(StackOps);
    LADLE_FIELD(StackOps, add_rmsnorm);
    LADLE_FIELD(StackOps, gemm);
    LADLE_FIELD(StackOps, gemm_gated);
    LADLE_FIELD(StackOps, qk_norm_rope);
    LADLE_FIELD(StackOps, attention);
    LADLE_SIZE(StackLinear);
    LADLE_FIELD(StackLinear, packed);
    LADLE_FIELD(StackLinear, n);
    LADLE_FIELD(StackLinear, k);
    LADLE_FIELD(StackLinear, kb);
    LADLE_SIZE(StackLayer);
    LADLE_FIELD(StackLayer, input_norm);
    LADLE_FIELD(StackLayer, post_norm);
    LADLE_FIELD(StackLayer, qk_norm);
    LADLE_FIELD(StackLayer, qkv);
    LADLE_FIELD(StackLayer, o);
    LADLE_FIELD(StackLayer, gate_up);
    LADLE_FIELD(StackLayer, down);
    LADLE_FIELD(StackLayer, k_cache);
    LADLE_FIELD(StackLayer, v_cache);
    LADLE_SIZE(StackStep);
    LADLE_FIELD(StackStep, rows);
    LADLE_FIELD(StackStep, hidden);
    LADLE_FIELD(StackStep, q_heads);
    LADLE_FIELD(StackStep, kv_heads);
    LADLE_FIELD(StackStep, head_dim);
    LADLE_FIELD(StackStep, act);
    LADLE_FIELD(StackStep, lanes);
    LADLE_FIELD(StackStep, threads);
    LADLE_FIELD(StackStep, eps);
    LADLE_FIELD(StackStep, qk_eps);
    LADLE_FIELD(StackStep, cos);
    LADLE_FIELD(StackStep, sin);
    LADLE_FIELD(StackStep, cos_row);
    LADLE_FIELD(StackStep, sin_row);
    LADLE_FIELD(StackStep, input);
    LADLE_FIELD(StackStep, x);
    LADLE_FIELD(StackStep, residual);
    LADLE_FIELD(StackStep, h);
    LADLE_FIELD(StackStep, qkv);
    LADLE_FIELD(StackStep, qk);
    LADLE_FIELD(StackStep, attn);
    LADLE_FIELD(StackStep, o);
    LADLE_FIELD(StackStep, gate_up);
    LADLE_FIELD(StackStep, attention_args);
    LADLE_FIELD(StackStep, args_k_cache);
    LADLE_FIELD(StackStep, args_v_cache);
    return out;
  }();
  return text.c_str();
}
}  // extern "C"
