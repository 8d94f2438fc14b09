"""ModelArch: the hyperparameters of one supported model, parsed from an HF config.json dict.

One parser serves every family. Keys a config leaves out take the defaults of transformers' own config
class for that family, so a short `architecture:` dict in a Hydra file means what it would mean to HF.
RoPE settings are read from the new form (`rope_parameters`, flat or per layer type) and from the
legacy form (`rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq`) and normalised to one dict
per layer type.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"

# architectures[0] -> (family, HF model_type). The family picks the layer class in models/model.py (LAYER_CLASSES).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "llama"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
    "Gemma3ForCausalLM": ("gemma3", "gemma3_text"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "MistralForCausalLM": ("mistral", "mistral"),
    "Phi3ForCausalLM": ("phi3", "phi3"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3_moe"),
    "MixtralForCausalLM": ("mixtral", "mixtral"),
}
MODEL_TYPES = {model_type: family for family, model_type in ARCHITECTURES.values()}

# The defaults of transformers' config class of each family (transformers 5.x).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": 10000.0,
    },
    "qwen3": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "rope_theta": 10000.0,
    },
    "gemma3": {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "rope_theta": 10000.0,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "sliding_window": 4096,
        "rope_theta": 10000.0,
    },
    "phi3": {
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "pad_token_id": 32000,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "rope_theta": 10000.0,
    },
    "qwen3_moe": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "rope_theta": 10000.0,
        "num_local_experts": 128,  # transformers saves num_experts under this name
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mixtral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "rope_theta": 1_000_000.0,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
}
for _defaults in _DEFAULTS.values():
    _defaults.setdefault("initializer_range", 0.02)
    _defaults.setdefault("rms_norm_eps", 1e-6)

# Families whose attention has a per-head RMSNorm on q and k; families whose layers are mixtures of experts
# (a router and `num_experts` MLPs, models/moe.py) where `sparse_layers` says so.
QK_NORM_FAMILIES = frozenset({"qwen3", "gemma3", "qwen3_moe"})
MOE_FAMILIES = frozenset({"qwen3_moe", "mixtral"})

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_ROPE_ALIASES = {"su": "longrope"}  # Phi-3's first configs named LongRoPE "su"


@dataclass(slots=True)
class ModelArch:
    """Everything the model code and the engine need to know about a model's shape."""

    name: str  # HF model_type: "llama", "qwen3", "gemma3_text"
    family: str  # "llama", "qwen3", "gemma3"
    architecture: str  # HF class name, e.g. "Qwen3ForCausalLM"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int | None  # window of the sliding layers; None when no layer slides
    layer_types: list[str]  # per layer: "full_attention" | "sliding_attention"
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    rotary_dim: int = 0  # leading dims of a head that RoPE rotates (Phi's partial rotary); the rest pass
    # Mixture of experts (0 experts: every MLP is dense). sparse_layers: per layer, whether it is an MoE.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: list[bool] = field(default_factory=list)
    initializer_range: float = 0.02
    # One dict per layer type present: rope_type, rope_theta and the scaling keys of that type.
    rope_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    attention_scale: float = 0.0  # softmax scale; head_dim**-0.5 unless the family says otherwise
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    torch_dtype: str | None = None  # the checkpoint's dtype as config.json states it, if it does

    @property
    def model_type(self) -> str:
        return self.name

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None for a full-attention layer)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token takes in the KV cache over all layers (K and V)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def qk_norm(self) -> bool:
        return self.family in QK_NORM_FAMILIES

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    def mlp_parameters(self, layer: int) -> int:
        """Parameters of one layer's MLP: every expert and the router of a sparse one."""
        h = self.hidden_size
        if self.is_sparse(layer):
            return self.num_experts * (3 * h * self.moe_intermediate_size + h)
        i = self.intermediate_size
        return 3 * h * i + (2 * i + h if self.mlp_bias else 0)

    def mlp_activation_width(self) -> int:
        """Floats per token an MLP's activations take, in units of three (the dense gate, up and product):
        an MoE layer holds each token's top-k copies of the hidden state (gathered, computed, weighted)
        beside its experts' gate, up and product."""
        width = self.intermediate_size if not all(self.sparse_layers or [False]) else 0
        if any(self.sparse_layers):
            width = max(width, self.num_experts_per_tok * (self.moe_intermediate_size + self.hidden_size))
        return width

    def num_parameters(self) -> int:
        """Parameter count from the shapes alone (tied embeddings counted once, every expert counted)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_proj_bias:
            attn += h
        norms = 2 * h + (2 * d if self.qk_norm else 0) + (2 * h if self.family == "gemma3" else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        mlps = sum(self.mlp_parameters(layer) for layer in range(self.num_layers))
        return self.num_layers * (attn + norms) + mlps + embed + h


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def family_of(config: dict[str, Any]) -> tuple[str, str]:
    """(family, architecture class name) of an HF config dict; ValueError names the supported ones."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch][0], arch
    model_type = config.get("model_type")
    if not archs and model_type in MODEL_TYPES:
        family = MODEL_TYPES[model_type]
        arch = next(a for a, (f, _) in ARCHITECTURES.items() if f == family)
        return family, arch
    supported = ", ".join(f"{a} (model_type {t})" for a, (_, t) in ARCHITECTURES.items())
    hint = ""
    if model_type == "gemma3" or "Gemma3ForConditionalGeneration" in archs:
        hint = " Multimodal Gemma 3 checkpoints are not supported; use a text-only one (e.g. google/gemma-3-1b-it)."
    raise ValueError(
        f"unsupported model architecture {archs or None} (model_type {model_type!r}); "
        f"ladle supports: {supported}.{hint}"
    )


def _rope_entry(params: dict[str, Any] | None, theta: float, max_pos: int,
                original_max: int | None = None) -> dict[str, Any]:
    params = dict(params or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
    params.pop("type", None)
    params.pop("partial_rotary_factor", None)  # ModelArch.rotary_dim
    params["rope_type"] = rope_type
    params.setdefault("rope_theta", theta)
    params["rope_theta"] = float(params["rope_theta"])
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; ladle supports {list(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "longrope":
        return _longrope_entry(params, max_pos, original_max)
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", max_pos)
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"rope_type 'llama3' needs {key!r} in rope_scaling/rope_parameters")
    if rope_type == "linear" and "factor" not in params:
        raise ValueError("rope_type 'linear' needs 'factor' in rope_scaling/rope_parameters")
    return params


def _longrope_entry(params: dict[str, Any], max_pos: int, original_max: int | None) -> dict[str, Any]:
    """LongRoPE (Phi-3/4): short and long per-frequency factors, and the attention factor that scales cos
    and sin, defaulted as transformers does (from max / original positions when `factor` is absent)."""
    for key in ("short_factor", "long_factor"):
        if key not in params:
            raise ValueError(f"rope_type 'longrope' needs {key!r} in rope_scaling/rope_parameters")
    params.setdefault("original_max_position_embeddings", original_max or max_pos)
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / original
    if params.get("attention_factor") is None:
        params["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return params


def _rope_parameters(cfg: dict[str, Any], family: str, layer_types: list[str]) -> dict[str, dict[str, Any]]:
    max_pos = cfg["max_position_embeddings"]
    rope = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    types = sorted(set(layer_types))
    nested = isinstance(rope, dict) and any(k in (FULL, SLIDING) for k in rope)
    if family == "gemma3":
        # Legacy: rope_theta/rope_scaling are the global (full) layers', rope_local_base_freq the sliding ones'.
        per_type = dict(rope) if nested else {}
        full = dict(per_type.get(FULL) or {})
        if scaling:
            full.update(scaling)
        out = {
            FULL: _rope_entry(full, cfg["rope_theta"], max_pos),
            SLIDING: _rope_entry(per_type.get(SLIDING), cfg["rope_local_base_freq"], max_pos),
        }
        return {t: out[t] for t in types}
    original = cfg.get("original_max_position_embeddings")
    if nested:
        return {t: _rope_entry(rope.get(t), cfg["rope_theta"], max_pos, original) for t in types}
    entry = _rope_entry(scaling or rope, cfg["rope_theta"], max_pos, original)
    return {t: dict(entry) for t in types}


def _layer_types(cfg: dict[str, Any], family: str) -> list[str]:
    n = cfg["num_hidden_layers"]
    if family in ("qwen3", "qwen2", "qwen3_moe") and not cfg.get("use_sliding_window"):
        return [FULL] * n  # HF Qwen drops the window unless use_sliding_window, whatever layer_types say
    if family in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        # Every layer slides when a window is set (transformers ignores layer_types for these families); a
        # window no shorter than the longest sequence (Phi-4-mini's 262144) is full attention.
        window = cfg.get("sliding_window")
        return [SLIDING if window and window < cfg["max_position_embeddings"] else FULL] * n
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])[:n]
        if len(types) != n or any(t not in (FULL, SLIDING) for t in types):
            raise ValueError(
                f"layer_types must list {n} entries of {FULL!r}/{SLIDING!r}, got {cfg['layer_types']}"
            )
        return types
    if family == "gemma3":
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if family in ("qwen3", "qwen2") and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        return [SLIDING if i >= cfg["max_window_layers"] else FULL for i in range(n)]
    return [FULL] * n


def arch_from_config(config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelArch:
    """Parse an HF config.json dict (plus generation_config.json, for EOS ids) into a ModelArch."""
    family, arch_name = family_of(config)
    cfg = {**_DEFAULTS[family], **{k: v for k, v in config.items() if v is not None or k in _NULLABLE}}
    if family == "gemma3" and cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    layer_types = _layer_types(cfg, family)
    sliding = cfg.get("sliding_window") if SLIDING in layer_types else None
    if SLIDING in layer_types and not sliding:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    eos = _ids((generation_config or {}).get("eos_token_id")) or _ids(cfg.get("eos_token_id"))
    scale, act, attn_softcap = _scale_activation_softcap(cfg, family, head_dim)
    return ModelArch(
        name=cfg.get("model_type") or ARCHITECTURES[arch_name][1],
        family=family,
        architecture=arch_name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg["max_position_embeddings"],
        sliding_window=int(sliding) if sliding else None,
        layer_types=layer_types,
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        hidden_act=act,
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        mlp_bias=bool(cfg.get("mlp_bias")),
        initializer_range=float(cfg.get("initializer_range") or 0.02),
        rope_parameters=_rope_parameters(cfg, family, layer_types),
        attention_scale=scale,
        attn_logit_softcapping=attn_softcap,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        **_projection_fields(cfg, family, head_dim),
        **_moe_fields(cfg, family),
    )


def _scale_activation_softcap(cfg: dict[str, Any], family: str, head_dim: int) -> tuple[float, str, float | None]:
    """The softmax scale, the MLP activation and the attention logit soft-cap (Gemma's own keys)."""
    attn_softcap = cfg.get("attn_logit_softcapping")
    if family != "gemma3":
        return head_dim**-0.5, cfg.get("hidden_act") or "silu", attn_softcap
    if attn_softcap is not None:
        # transformers' Gemma 3 keeps this key but never applies it (q/k norm replaced it), so neither
        # does ladle: outputs must match the reference implementation checkpoints are validated on.
        warnings.warn(f"Gemma 3 ignores attn_logit_softcapping={attn_softcap} (as transformers does)", stacklevel=3)
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    return float(cfg["query_pre_attn_scalar"]) ** -0.5, act, None


def _projection_fields(cfg: dict[str, Any], family: str, head_dim: int) -> dict[str, Any]:
    """Biases as transformers' attention classes set them (attention_bias covers q/k/v and o for Llama,
    Qwen3 and Gemma 3; Qwen2 always biases q/k/v and never o; Mistral, Phi-3 and Mixtral never bias) and
    the rotary width (Phi's partial_rotary_factor, top level or in rope_parameters)."""
    bias = bool(cfg.get("attention_bias")) and family not in ("mistral", "phi3", "mixtral")
    qkv_bias, o_bias = (True, False) if family == "qwen2" else (bias, bias)
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor={factor} gives {rotary_dim} rotary dims of head_dim={head_dim}: "
                         f"it must be an even count in (0, head_dim]")
    return {"attention_bias": qkv_bias, "o_proj_bias": o_bias, "rotary_dim": rotary_dim}


def _moe_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """Experts, top-k and which layers are sparse: Qwen3-MoE's decoder_sparse_step / mlp_only_layers
    (as transformers' Qwen3MoeDecoderLayer decides), every layer for Mixtral."""
    if family not in MOE_FAMILIES:
        return {}
    n, experts = cfg["num_hidden_layers"], cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    top_k = cfg["num_experts_per_tok"]
    if experts and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({experts})")
    if family == "mixtral":
        sparse = [experts > 0] * n
        intermediate, norm = cfg["intermediate_size"], True
    else:
        step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
        sparse = [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)]
        intermediate, norm = cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob"))
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": intermediate,
            "norm_topk_prob": norm, "sparse_layers": sparse}


# Keys whose explicit null in config.json overrides a non-null default (e.g. "no softcapping").
_NULLABLE = frozenset(
    {"final_logit_softcapping", "attn_logit_softcapping", "bos_token_id", "eos_token_id", "pad_token_id",
     "sliding_window"}  # Mistral-7B-v0.3's explicit null: no window, where MistralConfig's default is 4096
)
