"""PNG plots of a run (matplotlib, Agg backend: no display needed).

- schedule.png: per engine step, prefill and decode tokens (stacked), step duration, and the running /
  waiting requests with KV blocks in use: what the chunking policy did.
- latency.png: the ITL distribution (with p50 / p99) and the CDFs of TTFT and E2E latency.
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

from runner.report import itl_gaps


def plot_schedule(steps_path: Path, out: Path, title: str = "") -> Path:
    t = pq.read_table(steps_path, columns=["decode_tokens", "prefill_tokens", "duration_s", "running",
                                           "waiting", "kv_blocks_used"])
    x = np.arange(t.num_rows)
    dec = t.column("decode_tokens").to_numpy(zero_copy_only=False).astype(float)
    pre = t.column("prefill_tokens").to_numpy(zero_copy_only=False).astype(float)
    dur = t.column("duration_s").to_numpy(zero_copy_only=False) * 1e3
    fig, axes = plt.subplots(3, 1, figsize=(11, 7.5), sharex=True, constrained_layout=True)
    ax = axes[0]
    ax.fill_between(x, 0, dec, step="post", color="tab:blue", alpha=0.8, label="decode tokens", linewidth=0)
    ax.fill_between(x, dec, dec + pre, step="post", color="tab:orange", alpha=0.8, label="prefill tokens",
                    linewidth=0)
    ax.set_ylabel("tokens / step")
    ax.legend(loc="upper right")
    ax.set_title(title or "schedule")
    axes[1].step(x, dur, where="post", color="tab:red", linewidth=0.8)
    axes[1].set_ylabel("step duration (ms)")
    ax = axes[2]
    ax.step(x, t.column("running").to_numpy(zero_copy_only=False), where="post", label="running")
    ax.step(x, t.column("waiting").to_numpy(zero_copy_only=False), where="post", label="waiting")
    ax.set_ylabel("requests")
    ax.set_xlabel("engine step")
    ax2 = ax.twinx()
    ax2.step(x, t.column("kv_blocks_used").to_numpy(zero_copy_only=False), where="post", color="tab:gray",
             linestyle=":", label="KV blocks used")
    ax2.set_ylabel("KV blocks")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_latency(gen_path: Path, out: Path, title: str = "") -> Path:
    t = pq.read_table(gen_path, columns=["finish_reason", "ttft_s", "e2e_s", "token_times_s"])
    t = t.filter(pc.fill_null(pc.not_equal(t.column("finish_reason"), "error"), True))
    itl = itl_gaps(t.column("token_times_s")) * 1e3 if t.num_rows else np.zeros(0)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    ax = axes[0]
    if itl.size:
        lo, hi = float(itl.min()), float(itl.max())
        if hi - lo < 1e-6 * max(hi, 1e-9):  # (nearly) constant gaps: one visible bar
            lo, hi = lo * 0.95, hi * 1.05 + 1e-9
        ax.hist(itl, bins=min(60, max(10, int(np.sqrt(itl.size)))), range=(lo, hi), color="tab:blue", alpha=0.85)
        for q, style in ((50, "--"), (99, ":")):
            v = float(np.percentile(itl, q))
            ax.axvline(v, color="black", linestyle=style, label=f"p{q} {v:.2f} ms")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no inter-token gaps", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("tokens")
    ax.set_title(f"ITL distribution{' - ' + title if title else ''}")
    ax = axes[1]
    for name, color in (("ttft_s", "tab:orange"), ("e2e_s", "tab:green")):
        v = pc.fill_null(t.column(name).cast(pa.float64()), np.nan).to_numpy(zero_copy_only=False) * 1e3
        v = np.sort(v[np.isfinite(v)])
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", color=color, label=name[:-2].upper())
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT and E2E (CDF)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
