"""Compare the runs of a multirun: sweep.parquet, sweep.md and sweep.png at the sweep root.

`SweepReport` is a Hydra callback (listed under hydra.callbacks in conf/config.yaml); after the last
job of a `--multirun` it reads every run's summary.json (which records the run's overrides) and
writes one row per run. `python -m ladle.runner.sweep <sweep dir>` rebuilds the report by hand.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ladle.runner.sweep_tokens import TokenDiff, compare_runs, tokens_line

log = logging.getLogger("ladle")

COLUMNS = [  # (column, summary path, markdown header, scale for the table)
    ("requests", ("requests",), "requests", None),
    ("errors", ("errors",), "errors", None),
    ("req_per_s", ("throughput", "requests_per_s"), "req/s", None),
    ("output_tok_per_s", ("throughput", "output_tokens_per_s"), "out tok/s", None),
    ("input_tok_per_s", ("throughput", "input_tokens_per_s"), "in tok/s", None),
    ("busy_tok_per_s", ("throughput", "busy_tokens_per_s"), "tok/s busy", None),
    ("ttft_p50_ms", ("latency_s", "ttft", "p50"), "TTFT p50 ms", 1e3),
    ("ttft_p99_ms", ("latency_s", "ttft", "p99"), "TTFT p99 ms", 1e3),
    ("itl_p50_ms", ("latency_s", "itl", "p50"), "ITL p50 ms", 1e3),
    ("itl_p99_ms", ("latency_s", "itl", "p99"), "ITL p99 ms", 1e3),
    ("tpot_mean_ms", ("latency_s", "tpot", "mean"), "TPOT mean ms", 1e3),
    ("e2e_p50_ms", ("latency_s", "e2e", "p50"), "E2E p50 ms", 1e3),
    ("kv_peak_pct", ("kv_peak_fraction",), "peak KV %", 100.0),
    ("preemptions", ("preemptions",), "preemptions", None),
    ("prefix_cache_hit_rate", ("prefix_cache_hit_rate",), "prefix hit", None),
    ("steps", ("steps", "count"), "steps", None),
]


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for f in sorted(Path(sweep_dir).glob("**/summary.json")):
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            log.warning("skipping %s: %s", f, e)
            continue
        overrides = s.get("overrides")
        if overrides is None:  # written by an older runner: fall back to Hydra's own record
            ov = f.parent / ".hydra" / "overrides.yaml"
            overrides = _read_overrides(ov) if ov.exists() else []
        row = {"run": str(f.parent.relative_to(sweep_dir)), "overrides": list(overrides),
               "chunk_size": _get(s, ("config", "chunking", "size")),
               "complete": s.get("complete") is not False}  # interrupted, or a failed replica: False
        for name, path, _, scale in COLUMNS:
            v = _get(s, path)
            row[name] = v * scale if (scale and v is not None) else v
        rows.append(row)
    rows.sort(key=lambda r: (len(r["run"]), r["run"]))
    # What tells the runs apart: the overrides not shared by all of them (the swept values).
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if rows else set()
    for r in rows:
        r["varied"] = " ".join(o for o in r["overrides"] if o not in common)
        r["overrides"] = " ".join(r["overrides"])
    add_token_agreement(sweep_dir, rows)
    return rows


def add_token_agreement(sweep_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Per run: same_tokens (its tokens equal the first run's for every request; null without
    generations) and first_token_diff (where they first differ)."""
    result = compare_runs(sweep_dir, [r["run"] for r in rows])
    reference = next((run for run, v in result.items() if v != "no generations"), "")
    for r in rows:
        v = result[r["run"]]
        r["same_tokens"] = None if v == "no generations" else v is None
        r["first_token_diff"] = v.describe(reference) if isinstance(v, TokenDiff) else None


def _read_overrides(path: Path) -> list[str]:
    from omegaconf import OmegaConf

    return [str(x) for x in OmegaConf.load(path)]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.1f}"
    return str(v)


def _label(row: dict[str, Any]) -> str:
    return row["varied"] or row["run"]


KNEE_TOLERANCE = 0.05  # the knee: the smallest chunk within 5% of the best throughput


def answers(rows: list[dict[str, Any]]) -> list[str]:
    """What the sweep says, one line each: best P99 ITL, best TTFT p50, best throughput, the knee."""
    whole = [r for r in rows if r.get("complete", True)]  # a run stopped early would win on a few requests

    def best(col: str, low: bool) -> dict[str, Any] | None:
        have = [r for r in whole if r.get(col) is not None]
        return (min if low else max)(have, key=lambda r: r[col]) if have else None

    out = [line] if (line := tokens_line(rows)) else []
    for col, what, unit, low in (("itl_p99_ms", "P99 ITL", "ms", True), ("ttft_p50_ms", "TTFT p50", "ms", True),
                                 ("busy_tok_per_s", "throughput", "tok/s busy", False)):
        r = best(col, low)
        if r is not None:
            out.append(f"- Best {what}: `{_label(r)}` ({_fmt(r[col])} {unit})")
    top = best("busy_tok_per_s", False)
    sized = [r for r in whole if r.get("chunk_size") is not None and r.get("busy_tok_per_s") is not None]
    if top is not None and len({r["chunk_size"] for r in sized}) > 1:
        near = [r for r in sized if r["busy_tok_per_s"] >= (1 - KNEE_TOLERANCE) * top["busy_tok_per_s"]]
        knee = min(near, key=lambda r: r["chunk_size"])
        out.append(f"- Knee: chunking.size={knee['chunk_size']} (`{_label(knee)}`), the smallest chunk within "
                   f"{KNEE_TOLERANCE:.0%} of the best throughput ({_fmt(knee['busy_tok_per_s'])} tok/s busy)")
    if len(whole) < len(rows):
        cut = ", ".join(f"`{_label(r)}`" for r in rows if r not in whole)
        out.append(f"- Incomplete (interrupted, or a replica failed), left out of the lines above: {cut}")
    return out


def write_markdown(rows: list[dict[str, Any]], path: Path) -> None:
    heads = ["run", "swept"] + [h for _, _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        run = r["run"] if r.get("complete", True) else f"{r['run']} (incomplete)"
        cells = [run, f"`{r['varied']}`" if r["varied"] else ""] + [_fmt(r[n]) for n, *_ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    common = set(rows[0]["overrides"].split()) - {o for r in rows for o in r["varied"].split()} if rows else set()
    shared = f"Overrides shared by every run: `{' '.join(sorted(common))}`\n\n" if common else ""
    summary = "\n".join(answers(rows))
    path.write_text("# Sweep\n\n" + (summary + "\n\n" if summary else "") + shared + "\n".join(lines) + "\n")


def write_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Left: the trade-off, P99 ITL against TTFT p50, one labelled point per run (a line through
    them in chunk-size order). Right: bars of TTFT, ITL and busy throughput per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [_label(r) for r in rows]
    x = np.arange(len(rows))
    fig = plt.figure(figsize=(max(14, 1.4 * len(rows) * 4), 4.8), constrained_layout=True)
    grid = fig.add_gridspec(1, 4, width_ratios=[1.3, 1, 1, 1])
    ax = fig.add_subplot(grid[0])
    pts = [(r["ttft_p50_ms"], r["itl_p99_ms"], r) for r in rows
           if r.get("ttft_p50_ms") is not None and r.get("itl_p99_ms") is not None]
    if all(p[2].get("chunk_size") is not None for p in pts):
        pts.sort(key=lambda p: p[2]["chunk_size"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:gray", linewidth=0.8, zorder=1)
    for tx, ty, r in pts:
        ax.scatter([tx], [ty], zorder=2)
        name = f"size {r['chunk_size']}" if r.get("chunk_size") is not None and "chunking.size" in r["varied"] \
            else _label(r)
        ax.annotate(name, (tx, ty), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("TTFT p50 (ms)")
    ax.set_ylabel("ITL p99 (ms)")
    ax.set_title("trade-off: stalls vs first token")
    ax.grid(alpha=0.3)
    panels = [("TTFT (ms)", ["ttft_p50_ms", "ttft_p99_ms"]), ("ITL (ms)", ["itl_p50_ms", "itl_p99_ms"]),
              ("throughput (tok/s busy)", ["busy_tok_per_s"])]
    for i, (title, cols) in enumerate(panels):
        ax = fig.add_subplot(grid[i + 1])
        width = 0.8 / len(cols)
        for j, c in enumerate(cols):
            vals = [np.nan if r.get(c) is None else r[c] for r in rows]
            ax.bar(x + (j - (len(cols) - 1) / 2) * width, vals, width,
                   label=c.split("_")[1] if len(cols) > 1 else None)
        ax.set_title(title)
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
        if len(cols) > 1:
            ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_sweep_report(sweep_dir: str | Path) -> dict[str, Path]:
    """Write sweep.parquet / sweep.md / sweep.png in `sweep_dir`; returns their paths (empty: no runs)."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    if not rows:
        log.warning("no summary.json under %s: no sweep report", sweep_dir)
        return {}
    out = {"parquet": sweep_dir / "sweep.parquet", "markdown": sweep_dir / "sweep.md", "plot": sweep_dir / "sweep.png"}
    fields = [pa.field("run", pa.string()), pa.field("overrides", pa.string()), pa.field("varied", pa.string()),
              pa.field("chunk_size", pa.int64()), pa.field("complete", pa.bool_())]
    for name, *_ in COLUMNS:
        kind = pa.int64() if name in ("requests", "errors", "preemptions", "steps") else pa.float64()
        fields.append(pa.field(name, kind))
    fields += [pa.field("same_tokens", pa.bool_()), pa.field("first_token_diff", pa.string())]
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema(fields)), out["parquet"])
    write_markdown(rows, out["markdown"])
    try:
        write_plot(rows, out["plot"])
    except Exception as e:  # noqa: BLE001 - the table matters more than the picture
        log.warning("sweep plot failed: %s", e)
        del out["plot"]
    return out


class SweepReport(Callback):
    """Hydra callback: the sweep report after a multirun (a single run does nothing)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        files = write_sweep_report(sweep_dir)
        if files:
            print((sweep_dir / "sweep.md").read_text())
            print(f"sweep report in {sweep_dir.resolve()}: " + ", ".join(p.name for p in files.values()))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m ladle.runner.sweep <sweep directory>")
    for p in write_sweep_report(sys.argv[1]).values():
        print(p)
