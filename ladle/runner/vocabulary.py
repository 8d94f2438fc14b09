"""Config values that only the model's vocabulary can check, checked before the model loads.

The vocabulary size comes from the model's config files (`ladle.models.resolve_architecture` reads no
weights). Without this, the engine would meet an id outside the vocabulary only when a request uses
it (the grammar layer among others).
"""

from __future__ import annotations

from typing import Any


def stop_token_ids_error(ids: list[int], model: Any, key: str = "sampling.stop_token_ids") -> str | None:
    """Why config-wide token ids (`sampling.stop_token_ids`, the keys of `sampling.logit_bias`: `key`)
    cannot be used with `model` (a ModelConfig), or None."""
    ids = list(ids)
    if not ids:
        return None  # nothing to check: no need to read the model's config files
    from ladle.models import resolve_architecture

    try:
        _, arch = resolve_architecture(model.path, model.architecture, model.random_weights)
    except (FileNotFoundError, ValueError, KeyError) as e:  # what the engine's config phase reports as well
        return str(e)
    bad = [t for t in ids if not 0 <= t < arch.vocab_size]
    if not bad:
        return None
    shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    return (f"{key}={ids!r:.200}: [{shown}] outside the vocabulary [0, {arch.vocab_size}) of "
            f"model {model.name!r}; use ids of this model's tokenizer")
