"""load_model: resolve a model directory (local or the local HF cache), build the module, fill its weights.

Weights come from *.safetensors (one file or shards with model.safetensors.index.json). Without weights,
or without a path but with an `architecture` dict, the weights are random (normal(0,
initializer_range), deterministic from `seed`) and a RandomWeightsWarning says so. The Hub is never
contacted: repo ids resolve only through the local cache.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ladle.models.config import ModelArch, arch_from_config
from ladle.models.linear import Linear
from ladle.models.model import CausalLM


class RandomWeightsWarning(UserWarning):
    """The model runs with random weights: its outputs are meaningless (fine for tests and timings)."""


def hf_cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _looks_like_repo_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and "\\" not in path


def resolve_model_dir(path: str) -> Path:
    """A local directory as is; an HF repo id through the local cache only. FileNotFoundError otherwise."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if _looks_like_repo_id(path):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        cache = hf_cache_dir()
        try:
            return Path(snapshot_download(repo_id=path, local_files_only=True, cache_dir=cache))
        except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, OSError):
            raise FileNotFoundError(
                f"model.path={path!r}: not a local directory, and not in the local Hugging Face cache "
                f"({cache}; HF_HUB_CACHE or HF_HOME choose another). ladle never downloads: fetch it first "
                f"(`huggingface-cli download {path}`) or set model.path to a local copy."
            ) from None
    raise FileNotFoundError(
        f"model.path={path!r} does not exist (no such directory, and not an HF repo id of the form "
        f"org/name to look up in the local cache {hf_cache_dir()}). Set model.path to a local model "
        f"directory or to a repo id present in the local cache."
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or every *.safetensors."""
    index = _read_json(model_dir / "model.safetensors.index.json")
    if index is not None:
        names = sorted(set(index["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{model_dir}: shards named in model.safetensors.index.json are missing: {missing}"
            )
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def build_model(arch: ModelArch, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """The module with uninitialised weights on `device` (built on `meta`, so nothing is allocated twice)."""
    with torch.device("meta"):
        model = CausalLM(arch)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.requires_grad_(False)
    return model.eval()


def checkpoint_targets(model: CausalLM) -> dict[str, tuple[torch.Tensor, slice | None]]:
    """Checkpoint tensor name -> (model parameter, its rows or None for all of it).

    The packed-modules mapping: a PackedLinear (`qkv_proj`, `gate_up_proj`) stands for several
    checkpoint tensors (`q_proj`, `k_proj`, `v_proj`; `gate_proj`, `up_proj`), each filling its rows.
    """
    from ladle.models.layers import PackedLinear

    targets: dict[str, tuple[torch.Tensor, slice | None]] = {}
    packed = {name: mod for name, mod in model.named_modules() if isinstance(mod, PackedLinear)}
    for name, param in model.named_parameters():  # tied lm_head appears once, as embed_tokens
        module_name, _, leaf = name.rpartition(".")
        module = packed.get(module_name)
        if module is None:
            targets[name] = (param, None)
            continue
        parent = module_name.rpartition(".")[0]
        for shard in module.shards:
            targets[f"{parent}.{shard}.{leaf}"] = (param, module.shard_rows(shard))
    return targets


# Checkpoint names that differ from the module names: Mixtral's experts (w1 gate, w3 up, w2 down).
_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                (".w2.", ".down_proj.")),
}


def _fused_splits(arch: ModelArch) -> dict[str, list[tuple[str, int]]]:
    """Fused checkpoint tensors (Phi-3's qkv_proj and gate_up_proj) -> the projections they stack, in
    row order: the loader fills each projection's place from its rows (the last layer holds q apart)."""
    if arch.family != "phi3":
        return {}
    q, kv, i = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    return {"self_attn.qkv_proj": [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
            "mlp.gate_up_proj": [("mlp.gate_proj", i), ("mlp.up_proj", i)]}


def checkpoint_pieces(arch: ModelArch, name: str) -> list[tuple[str, slice | None]]:
    """The module tensor names a checkpoint tensor fills, each with its rows of that tensor (None: all)."""
    for old, new in _RENAMES.get(arch.family, ()):
        name = name.replace(old, new)
    module, _, leaf = name.rpartition(".")
    for fused, parts in _fused_splits(arch).items():
        if module.endswith("." + fused):
            base, start, pieces = module[: -len(fused)], 0, []
            for part, rows in parts:
                pieces.append((f"{base}{part}.{leaf}", slice(start, start + rows)))
                start += rows
            return pieces
    return [(name, None)]


@torch.no_grad()
def load_weights(model: CausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its parameter (or packed rows), checking names and shapes."""
    targets = checkpoint_targets(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                for piece, source_rows in checkpoint_pieces(model.arch, name):
                    target = targets.get(piece)
                    if target is None:
                        if not (name == "lm_head.weight" and model.arch.tie_word_embeddings):
                            unexpected.append(name)
                        continue
                    _copy_piece(model.arch, f, file, name, source_rows, target)
                    loaded.add(piece)
    missing = [n for n in targets if n not in loaded]
    if missing:
        def shape_of(n: str) -> list[int]:
            param, rows = targets[n]
            return list((param if rows is None else param[rows]).shape)

        shown = ", ".join(f"{n!r} (shape {shape_of(n)})" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"checkpoint {files[0].parent} is missing tensor(s) {shown}{more} "
            f"(searched {[f.name for f in files]})"
        )
    if unexpected:
        warnings.warn(
            f"ignored {len(unexpected)} tensor(s) the model does not use: {unexpected[:5]}", stacklevel=3
        )


def _copy_piece(arch: ModelArch, f, file: Path, name: str, source_rows: slice | None,
                target: tuple[torch.Tensor, slice | None]) -> None:
    """Copy checkpoint tensor `name` (its `source_rows`, or all of it) into the target's rows."""
    param, rows = target
    dest = param if rows is None else param[rows]
    tensor = f.get_slice(name)
    shape = list(tensor.get_shape())
    if source_rows is not None:
        shape[0] = len(range(shape[0])[source_rows])
    if tuple(shape) != tuple(dest.shape):
        where = "" if source_rows is None else f" (rows {source_rows.start}:{source_rows.stop})"
        raise ValueError(
            f"tensor {name!r}{where} in {file.name} has shape {shape} but the model "
            f"({arch.architecture}) expects {list(dest.shape)}: the checkpoint does not match its config.json"
        )
    dest.copy_(f.get_tensor(name) if source_rows is None else tensor[source_rows])


@torch.no_grad()
def init_random(model: CausalLM, seed: int) -> None:
    """normal(0, initializer_range) for matrices, 1 for RMSNorm weights (0 for Gemma's 1+w), 0 for biases.

    Drawn in place on the target device and dtype from a generator seeded with `seed`.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    std = model.arch.initializer_range
    norm_value = 0.0 if model.arch.family == "gemma3" else 1.0
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(norm_value)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def load_model(
    path: str | None,
    architecture: dict[str, Any] | None,
    dtype: torch.dtype | str,
    device: torch.device | str,
    seed: int = 0,
    random_weights: bool = False,
    pack_linear: bool = True,
) -> CausalLM:
    """Build a supported causal LM with the weights of `path`, or random ones when asked for.

    path: an HF model directory or a repo id in the local HF cache. A path that cannot be found, or
      that has no weights, is an error (a typo must not turn into an hour of random outputs).
    architecture: config.json keys, used when path is None or has no config.json.
    random_weights: random weights even if `path` names weights (the shapes come from the path's
      config.json when it has one, else from `architecture`). path=None always means random weights.
    dtype: a torch dtype or a name; "auto" follows the checkpoint on CUDA (see resolve_dtype).
    """
    device = resolve_device(device)
    model_dir, arch = resolve_architecture(path, architecture, random_weights)
    model = build_model(arch, resolve_dtype(dtype, device, arch), device)
    if not pack_linear:  # the memory plan has no room for the packed copies (models/linear.py)
        for module in model.modules():
            if isinstance(module, Linear):
                module.use_packed = False
    files = weight_files(model_dir) if model_dir is not None and not random_weights else []
    if model_dir is not None and not random_weights and not files:
        raise FileNotFoundError(
            f"model.path={path!r}: {model_dir} has no *.safetensors weights; point model.path at a "
            f"complete checkpoint, or set model.random_weights=true to run this architecture with "
            f"random weights (for timings)"
        )
    if files:
        load_weights(model, files)
        model.derive_weights()
        return model
    why = "model.path is null" if path is None else "model.random_weights=true"
    warnings.warn(
        f"model weights are RANDOM ({arch.architecture}, {_count(arch.num_parameters())} parameters, "
        f"seed {seed}): {why}. Outputs are meaningless; timings are real.",
        RandomWeightsWarning,
        stacklevel=2,
    )
    init_random(model, seed)
    model.derive_weights()
    return model


def resolve_architecture(
    path: str | None, architecture: dict[str, Any] | None, random_weights: bool = False
) -> tuple[Path | None, ModelArch]:
    """The model directory (None for random weights) and its architecture, reading only config files:
    what an engine needs to plan its memory before any weight is loaded."""
    model_dir = _find_model_dir(path, architecture, random_weights)
    config = _read_json(model_dir / "config.json") if model_dir else None
    generation_config = _read_json(model_dir / "generation_config.json") if model_dir else None
    if config is None:
        if architecture is None:
            raise FileNotFoundError(
                f"model.path={path!r}: {model_dir} has no config.json; point model.path at an HF model "
                f"directory (config.json + *.safetensors) or give model.architecture (config.json keys)"
            )
        config = dict(architecture)
    return model_dir, arch_from_config(config, generation_config)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _find_model_dir(path: str | None, architecture: dict[str, Any] | None, random_weights: bool) -> Path | None:
    """The model directory, None for random weights; a path that cannot be found is an error unless
    random weights were asked for and the architecture is known without it."""
    if not path:
        return None
    try:
        return resolve_model_dir(str(path))
    except FileNotFoundError as exc:
        if random_weights and architecture is not None:
            return None
        hint = (" To run its architecture with random weights instead (for timings): model.random_weights=true."
                if architecture is not None else "")
        raise FileNotFoundError(f"{exc}{hint}") from None


def resolve_dtype(
    name: str | torch.dtype, device: torch.device | str, arch: ModelArch | None = None
) -> torch.dtype:
    """'auto' -> the checkpoint's bf16/fp16 on CUDA (bf16 if it says float32 or nothing), float32 on CPU."""
    if isinstance(name, torch.dtype):
        return name
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
    }
    if name in names:
        return names[name]
    if name != "auto":
        raise ValueError(f"unknown dtype {name!r}; use auto or one of {sorted(names)}")
    if torch.device(device).type == "cpu":
        return torch.float32
    wanted = names.get(arch.torch_dtype) if arch and arch.torch_dtype else None
    return wanted if wanted in (torch.bfloat16, torch.float16) else torch.bfloat16


def resolve_device(name: str | torch.device) -> torch.device:
    """The one device rule (engine and loader): 'auto' -> CUDA when available, else CPU; a CUDA device
    asked for by name must exist (a run meant for a GPU must not crawl along on the CPU instead)."""
    if isinstance(name, torch.device):
        device = name
    elif name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={str(name)!r} but CUDA is not available; use model.device=cpu or auto")
    return device
