"""Arrival rates relative to the machine: `arrivals.load` instead of a fixed `rate`.

A rate in requests per second means a different experiment on every machine: long prompts that
overlap running decodes on an H100 arrive after they finished on a laptop CPU. `load: 0.7` asks for
arrivals whose prefill work would fill 70% of the engine's time instead:

    rate = load / (mean prompt tokens x seconds per prefill token)

Seconds per prefill token come from a short calibration of the model at hand: whole-prompt forwards
of `PREFILL_TOKENS` tokens (minimum of a few tries: noise on a shared machine only adds time), timed
outside the engine's cache and independent of the chunking policy, so every run of a sweep over
chunking.size replays the same arrivals. A multirun calibrates once and shares the result through
`calibration.json` at the sweep root; jobs of a sweep that run at once (a parallel launcher) take turns
on it under an OS lock, so the first measures and the others read its numbers.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("ladle")

CALIBRATION = "calibration.json"  # a run's own copy (a resumed run replays the arrivals it started with)
PREFILL_TOKENS = 512
DECODE_BATCH = 8
DECODE_CONTEXT = 128
TRIES = 3


@dataclass(slots=True)
class Calibration:
    key: str  # what was measured: model, dtype, device (a cached calibration is reused only for the same)
    prefill_tokens: int
    prefill_s: float  # one whole forward of prefill_tokens prompt tokens
    decode_batch: int
    decode_step_s: float  # one forward of decode_batch decode tokens at decode_context tokens of context

    @property
    def prefill_s_per_token(self) -> float:
        return self.prefill_s / self.prefill_tokens

    def rate(self, load: float, mean_prompt_tokens: float) -> float:
        """Requests per second whose prefills would fill `load` of the engine's time."""
        return load / (max(mean_prompt_tokens, 1.0) * self.prefill_s_per_token)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prefill_s_per_token": self.prefill_s_per_token}


def engine_key(eng: Any) -> str:
    """What a timing of this engine depends on (a stored calibration is reused only for the same): the
    architecture's shapes, dtype, device, attention backend, compile, torch's threads and the longest
    sequence (it caps the calibrated prefill). Not the weights' values, which do not change speed."""
    import torch

    model = eng.config.model
    parts = {
        "arch": repr(eng.arch), "dtype": str(eng.dtype), "device": str(eng.device),
        "backend": model.attention_backend, "threads": torch.get_num_threads(),
        "max_model_len": eng.max_model_len, "compile": model.compile,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return f"{model.name}|{digest}"


def calibrate(eng: Any) -> Calibration:
    """Time the engine's model (`eng.time_forward`): a whole prefill and a decode step, minimum of
    TRIES after a warm-up."""
    from ladle.engine.profiling import prefill_shape

    n = min(PREFILL_TOKENS, eng.max_model_len)
    lens = prefill_shape(n, eng.max_model_len)
    ctx = min(DECODE_CONTEXT, eng.max_model_len)
    eng.time_forward(lens, lens)  # warm-up: allocator, kernels, caches
    prefill = min(eng.time_forward(lens, lens) for _ in range(TRIES))
    q, s = [1] * DECODE_BATCH, [ctx] * DECODE_BATCH
    eng.time_forward(q, s)
    decode = min(eng.time_forward(q, s) for _ in range(TRIES))
    return Calibration(engine_key(eng), n, prefill, DECODE_BATCH, decode)


def shared_calibration(eng: Any, paths: list[Path | None]) -> Calibration:
    """The calibration stored for this engine in the first of `paths` that has one (a run's own copy,
    then a sweep's), else a new one; stored in every path that lacks it."""
    key = engine_key(eng)
    files = [p for p in paths if p is not None]
    with ExitStack() as held:  # jobs of a sweep started together: one measures, the others wait and read it
        for p in sorted(set(files)):
            held.enter_context(_locked(p))
        return _read_or_measure(eng, key, files)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An OS lock (flock, blocking) on `.<name>.lock` beside `path` for the block; released however the
    process ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_or_measure(eng: Any, key: str, files: list[Path]) -> Calibration:
    found = next(((p, c) for p, c in ((p, _stored(p, key)) for p in files) if c is not None), None)
    if found is not None:
        log.info("arrival calibration from %s", found[0])
        cal = found[1]
    else:
        cal = calibrate(eng)
        log.info("arrival calibration: %d-token prefill %.4f s, %d-decode step %.4f s", cal.prefill_tokens,
                 cal.prefill_s, cal.decode_batch, cal.decode_step_s)
    for p in files:
        if _stored(p, key) != cal:
            _store(p, key, cal)
    return cal


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _stored(path: Path, key: str) -> Calibration | None:
    stored = _read(path).get(key)
    if not isinstance(stored, dict):
        return None
    stored = dict(stored)
    stored.pop("prefill_s_per_token", None)
    try:
        return Calibration(**stored)
    except TypeError:  # written by another version
        return None


def _store(path: Path, key: str, cal: Calibration) -> None:
    data = _read(path)
    data[key] = cal.as_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: never another's half-written one
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
