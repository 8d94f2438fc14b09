"""PNG plots of a run (matplotlib, Agg backend: no display needed).

- schedule.png: per engine step, prefill tokens and decode tokens (separate panels and scales), step
  duration, and the running / waiting requests with KV blocks in use: what the chunking policy did.
- latency.png: the ITL CDF per request class (p50 / p99 marked) and the TTFT CDF per class.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ladle.runner.report import itl_gaps


def _legend_outside(ax, handles=None, labels=None) -> None:
    """The legend to the right of the axes, never over the data."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=8)


def plot_schedule(steps_path: Path, out: Path, title: str = "") -> Path:
    """Four panels sharing the step axis: prefill tokens, decode tokens (each on its own scale, so a
    few decode tokens stay visible beside a prefill spike), step duration, requests and KV use."""
    t = pq.read_table(steps_path, columns=["decode_tokens", "prefill_tokens", "duration_s", "running",
                                           "waiting", "kv_blocks_used"])
    x = np.arange(t.num_rows)
    dec = t.column("decode_tokens").to_numpy(zero_copy_only=False).astype(float)
    pre = t.column("prefill_tokens").to_numpy(zero_copy_only=False).astype(float)
    dur = t.column("duration_s").to_numpy(zero_copy_only=False) * 1e3
    fig, axes = plt.subplots(4, 1, figsize=(11, 9), sharex=True, constrained_layout=True,
                             gridspec_kw={"height_ratios": [1.2, 1, 1, 1]})
    axes[0].set_title(title or "schedule")
    for ax, v, color, label in ((axes[0], pre, "tab:orange", "prefill tokens"),
                                (axes[1], dec, "tab:blue", "decode tokens")):
        ax.fill_between(x, 0, v, step="post", color=color, alpha=0.85, linewidth=0, label=label)
        ax.set_ylabel(label.replace(" tokens", "\ntokens / step"))
        ax.set_ylim(0, max(1.0, float(v.max(initial=0))) * 1.1)
        _legend_outside(ax)
    axes[2].step(x, dur, where="post", color="tab:red", linewidth=0.8, label="step duration")
    axes[2].set_ylabel("step (ms)")
    _legend_outside(axes[2])
    ax = axes[3]
    ax.step(x, t.column("running").to_numpy(zero_copy_only=False), where="post", label="running")
    ax.step(x, t.column("waiting").to_numpy(zero_copy_only=False), where="post", label="waiting")
    ax.set_ylabel("requests")
    ax.set_xlabel("engine step")
    ax2 = ax.twinx()
    ax2.step(x, t.column("kv_blocks_used").to_numpy(zero_copy_only=False), where="post", color="tab:gray",
             linestyle=":", label="KV blocks used (right)")
    ax2.set_ylabel("KV blocks")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, loc="upper left", bbox_to_anchor=(1.08, 1.0), borderaxespad=0, fontsize=8)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _cdf(ax, values: np.ndarray, label: str, color: str | None = None, mark: bool = False) -> None:
    v = np.sort(values[np.isfinite(values)])
    if not v.size:
        return
    line = ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=f"{label} (n={v.size})", color=color)
    if mark:
        for q, marker in ((50, "o"), (99, "v")):
            p = float(np.percentile(v, q))
            ax.plot([p], [q / 100], marker=marker, color=line[0].get_color(), markersize=6,
                    label=f"{label} p{q} {p:.1f} ms")


def plot_latency(gen_path: Path, out: Path, title: str = "") -> Path:
    """ITL CDF per request class (the `class` column: decode streams vs long prompts) with P50 / P99
    marked, and the CDFs of TTFT per class."""
    cols = ["finish_reason", "ttft_s", "token_times_s"]
    schema = pq.read_schema(gen_path)
    has_class = "class" in schema.names
    t = pq.read_table(gen_path, columns=cols + (["class"] if has_class else []))
    t = t.filter(pc.fill_null(pc.not_equal(t.column("finish_reason"), "error"), True))
    classes = [None]
    if has_class and t.num_rows:
        found = sorted({c for c in t.column("class").to_pylist() if c is not None})
        classes = found if 1 < len(found) <= 8 else [None]  # too many classes: one curve for all
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for klass in classes:
        part = t if klass is None else t.filter(pc.equal(t.column("class"), klass))
        name = "all" if klass is None else klass
        itl = itl_gaps(part.column("token_times_s")) * 1e3 if part.num_rows else np.zeros(0)
        _cdf(axes[0], itl, name, mark=True)
        ttft = pc.fill_null(part.column("ttft_s").cast(pa.float64()), np.nan).to_numpy(zero_copy_only=False) * 1e3
        _cdf(axes[1], ttft, name)
    for ax, what in ((axes[0], "inter-token latency"), (axes[1], "time to first token")):
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            _legend_outside(ax)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    axes[0].set_title(f"ITL CDF by request class{' - ' + title if title else ''}", fontsize=10)
    axes[1].set_title("TTFT CDF by request class", fontsize=10)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
