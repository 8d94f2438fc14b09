"""The causal LM every family shares: embeddings, decoder layers, final norm, LM head.

Module names mirror transformers' (`model.embed_tokens`, `model.layers.N.self_attn.o_proj`,
`model.norm`, `lm_head`); q/k/v and gate/up are packed into `qkv_proj` and `gate_up_proj` (the last
layer: `q_proj` and a packed `kv_proj`, models/layers.Attention.split_q), which the loader fills from the
checkpoint's separate tensors (models/loader.py, checkpoint_targets).
"""

from __future__ import annotations

import torch
from torch import nn

from ladle.kernels import AttentionMetadata, cpu_fused, cpu_layers
from ladle.models.attention_op import attention_context
from ladle.models.config import ModelArch
from ladle.models.cpu_stack import decoder_stack_op, run_layers, stackable
from ladle.models.cpu_stack import register as register_stack
from ladle.models.gemma3 import Gemma3DecoderLayer
from ladle.models.layers import MLP, RMSNorm, RotaryEmbedding
from ladle.models.linear import Linear, verify_batch_invariance
from ladle.models.llama import LlamaDecoderLayer

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# A dense family is a row here plus its config defaults (models/config.py): LlamaDecoderLayer reads its
# differences (q/k norm, biases, partial rotary, windows, experts) from the ModelArch.
LAYER_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaDecoderLayer,
    "qwen3": LlamaDecoderLayer,
    "qwen2": LlamaDecoderLayer,
    "mistral": LlamaDecoderLayer,
    "phi3": LlamaDecoderLayer,
    "qwen3_moe": LlamaDecoderLayer,
    "mixtral": LlamaDecoderLayer,
    "gemma3": Gemma3DecoderLayer,
}


class DecoderModel(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        layer_cls = LAYER_CLASSES[arch.family]
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(layer_cls(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, offset=arch.family == "gemma3")


class CausalLM(nn.Module):
    """forward(input_ids[T], positions[T], kv_caches, meta) -> hidden [T, hidden], or [R, hidden] for the
    rows meta.outputs names when set (AttentionMetadata.restrict_outputs);
    compute_logits(hidden[S, hidden]) -> float32 logits [S, vocab]."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.tie_weights()
        self.rope = {
            t: RotaryEmbedding(p, arch.rotary_dim or arch.head_dim, arch.max_position_embeddings)
            for t, p in arch.rope_parameters.items()
        }
        self._layer_types = list(arch.layer_types)
        # Gemma scales embeddings by sqrt(hidden), rounded to the model dtype first (as HF does): a
        # Python float per dtype, computed here so the forward holds no .item() (a compile graph break).
        self._embed_scale = (
            {dt: torch.tensor(arch.hidden_size**0.5, dtype=dt, device="cpu").item() for dt in _FLOAT_DTYPES}
            if arch.family == "gemma3"
            else None
        )
        self._compiled = None  # the torch.compile'd _forward once enable_compile() ran
        self._stack_key: torch.Tensor | None = None  # the compiled forward's ladle::decoder_stack key
        self.deterministic = False  # set_deterministic

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def derive_weights(self) -> None:
        """Precompute what the forward would otherwise derive from the weights on every call (Gemma's
        1 + norm weight, the per-head q/k norm weight). The loader calls it once the weights are final;
        call it again after changing weights by hand."""
        for module in self.modules():
            if module is not self and hasattr(module, "derive_weights"):
                module.derive_weights()

    def packed_weight_bytes(self) -> int:
        """Host memory of the linear layers' packed weights (models/linear.py), held beside the Parameters:
        what the CPU fast path adds to the model's footprint (0 on CUDA and for other dtypes)."""
        return sum(m.packed_bytes() for m in self.modules() if isinstance(m, Linear))

    def set_deterministic(self, enabled: bool = True) -> None:
        """Batch-invariant mode for the model's own ops: a row's hidden state and logits are
        bitwise the same whatever other rows share the forward and however many there are. Linear layers
        already are on their packed CPU path (models/linear.py), which this checks now for every weight
        shape at the current thread count, raising where it cannot hold (CUDA, non-float32, no oneDNN);
        the MLP activation switches to its exp/tanh form (models/layers.py, INVARIANT_ACTIVATIONS) where
        the fused CPU kernel (row-wise already, kernels/cpu_fused.py) does not run it.
        Norms, RoPE, embeddings and the residual stream are row-wise as they are (tests/models/
        test_batch_invariance.py). Attention is the kernel's business (kernels/)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if enabled:
            verify_batch_invariance(linears)
        for module in self.modules():
            if isinstance(module, (Linear, MLP)):
                module.deterministic = enabled
        self.deterministic = enabled

    def enable_compile(self) -> None:
        """Run the forward through torch.compile from now on (inductor: C++ on CPU, Triton on CUDA).

        One graph per forward (attention is the `ladle::attention` custom op, fullgraph=True makes a
        break an error) and one graph per run: the token count is a symbol nothing guards on, so every
        width reuses it. The compile itself happens on the first call: make it in a warm-up before
        timing (engine/profiling.compile_forward)."""
        if any(self.arch.sparse_layers):
            raise ValueError(
                f"model.compile=true is not supported for {self.arch.architecture}: its mixture-of-experts "
                f"layers group tokens by expert with host-side counts; set model.compile=false")
        param = next(self.parameters())
        if param.device.type == "cpu" and param.dtype == torch.float32:
            cpu_fused.enabled()  # decided (and the library built) now: the traced forward reads a constant
        # The layers before the last as one op (models/cpu_stack.py) where they can be, decided now (the trace
        # reads a constant); layers that never can keep their own ops in the graph.
        stack = self._stackable() and stackable(list(self.model.layers[:-1]))
        self._stack_key = register_stack(self.model.layers) if stack else None
        for rope in self.rope.values():  # tables built now, so the graph reads them instead of building them
            rope.prepare(param.device, param.dtype)
        options = None
        if param.dtype in (torch.bfloat16, torch.float16):
            # Eager's numerics, so compiled greedy outputs equal eager's (and transformers'): inductor
            # otherwise keeps fused bf16 intermediates in fp32 (one rounding where eager rounds per op)
            # and its pattern pass turns o_proj/down_proj + residual add into one addmm (the residual
            # summed inside the GEMM). Both changed greedy tokens of the tiny bf16 models.
            options = {"emulate_precision_casts": True, "pattern_matcher": False}
        self._compiled = torch.compile(self._forward, fullgraph=True, options=options)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def __getstate__(self) -> dict:
        # The compiled function is bound to this instance (and cannot be pickled): a copy (deepcopy,
        # torch.save/load) would run this model's layers. The copy compiles its own, sharing the graph.
        state = self.__dict__.copy()
        state["_compiled"] = self._compiled is not None
        return state

    def __setstate__(self, state: dict) -> None:
        recompile = state.pop("_compiled", None) is True
        # The stack key names the original's layers: the copy registers its own when it compiles.
        super().__setstate__({**state, "_compiled": None, "_stack_key": None})
        if recompile:
            self.enable_compile()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self._compiled is None:
            return self._forward(input_ids, positions, kv_caches, meta)
        # The token count is unbacked: no guard on it at all, so every width, 1 included, is one graph
        # (a merely dynamic size is specialised at 1 and would compile a second graph).
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        # The kept rows are always a graph input (every row when nothing is dropped): one graph for both.
        outputs = meta.outputs if meta.outputs is not None else meta.restrict_outputs([0] * meta.num_seqs)
        torch._dynamo.decorators.mark_unbacked(outputs.rows, 0)
        # The metadata and caches reach the attention op through the context, never as graph inputs.
        with attention_context(meta, kv_caches):
            return self._compiled(input_ids, positions, rows=outputs.rows)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None = None,
        meta: AttentionMetadata | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The forward; meta=None is the compiled form (attention reads the forward context), where
        `rows` are meta.outputs' rows; eager reads them from meta."""
        x = self.model.embed_tokens(input_ids)
        if self._embed_scale is not None:
            x = x * self._embed_scale[x.dtype]
        max_len = 1 if meta is None else max(meta.max_seq_len, 1)
        ropes = {t: rope(positions, max_len, x.dtype) for t, rope in self.rope.items()}
        residual = None
        last = len(self.model.layers) - 1
        if meta is not None and meta.outputs is not None and not meta.outputs.every_row:
            rows = meta.outputs.rows
        start = 0
        if meta is None and self._stack_key is not None:  # compiled: the custom op decides at run time
            x, residual = decoder_stack_op(x, *ropes[self._layer_types[0]], self._stack_key, last)
            start = last
        elif kv_caches is not None and self._stackable():
            # Eager on the CPU in float32: the layers before the last as one native call where they qualify
            # (models/cpu_stack.py; the same kernels, the same bits, no Python between them).
            done = run_layers(list(self.model.layers[:last]), x, ropes[self._layer_types[0]],
                                        kv_caches[:last], meta)
            if done is not None:
                (x, residual), start = done, last
        for i in range(start, len(self.model.layers)):
            layer = self.model.layers[i]
            cache = None if kv_caches is None else kv_caches[i]
            # The last layer carries on only the rows the caller reads (meta.outputs): on a prefill
            # chunk, its attention output, MLP and final norm for one row instead of hundreds.
            x, residual = layer(x, residual, ropes[self._layer_types[i]], cache, meta, rows if i == last else None)
        return self.model.norm.add_and_norm(x, residual)[0]

    def _stackable(self) -> bool:
        """Whether the layers before the last may go to models/cpu_stack: one kind of layer, on the CPU in
        float32 (models/cpu_stack checks each layer's weights and kernels, and each step's caches)."""
        last = len(self.model.layers) - 1
        param = self.lm_head.weight
        return last >= 1 and len(set(self._layer_types[:last])) == 1 and param.device.type == "cpu" \
            and param.dtype == torch.float32 and cpu_layers.enabled()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on the rows that sample; float32 out (softcapped for Gemma when configured)."""
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
