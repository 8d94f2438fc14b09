"""The model families (Llama 3.x, Qwen2/2.5, Qwen3, Mistral, Phi-3/4, Gemma 3, Qwen3-MoE, Mixtral) in plain
PyTorch, their weight loading and tokenizers.

Use: `model = load_model(path, architecture, dtype, device, seed)`, then per step
`hidden = model(input_ids, positions, kv_caches, meta)` ([T, hidden], or the rows of meta.outputs when
the caller restricted them) and `logits = model.compute_logits(hidden[rows])` (float32 [S, vocab]);
`model.arch` (ModelArch) has the shapes and EOS ids; `load_tokenizer(path, vocab_size, tokenizer)`.
"""

from ladle.models.config import ARCHITECTURES, ModelArch, arch_from_config
from ladle.models.loader import (
    RandomWeightsWarning,
    build_model,
    load_model,
    resolve_architecture,
    resolve_device,
    resolve_dtype,
    resolve_model_dir,
)
from ladle.models.model import CausalLM
from ladle.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ARCHITECTURES",
    "ByteTokenizer",
    "CausalLM",
    "HFTokenizer",
    "ModelArch",
    "RandomWeightsWarning",
    "Tokenizer",
    "arch_from_config",
    "build_model",
    "load_model",
    "load_tokenizer",
    "resolve_architecture",
    "resolve_device",
    "resolve_dtype",
    "resolve_model_dir",
]
