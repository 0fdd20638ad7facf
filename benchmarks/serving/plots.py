"""The serving benchmark's figures (matplotlib, Agg backend: no display needed): latency against
request rate, and the KV pool's usage over the rate sweep."""

from __future__ import annotations

from pathlib import Path

from benchmarks.serving.client import KvSampler


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency(baseline: dict, runs: list[dict], ttft_bound_s: float, path: Path, title: str) -> None:
    """TTFT and TPOT (p50, p99) per offered rate; the unloaded baseline's p99 and the TTFT bound as
    horizontal lines. Rates sit at even spacing (the last one may be "inf")."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=90)
    xs = list(range(len(runs)))
    for ax, metric, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for q, style in (("p50", "o-"), ("p99", "s-")):
            ax.plot(xs, [(r[metric][q] or float("nan")) * 1e3 for r in runs], style, label=f"{name} {q}")
        if baseline[metric]["p99"] is not None:
            ax.axhline(baseline[metric]["p99"] * 1e3, color="grey", ls="--", lw=1, label="unloaded p99")
        ax.set_xticks(xs, [r["rate"] for r in runs])
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
    axes[0].axhline(ttft_bound_s * 1e3, color="red", ls=":", lw=1, label=f"bound {ttft_bound_s:g} s")
    axes[0].set_yscale("log")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_kv_usage(sampler: KvSampler, path: Path, title: str) -> None:
    """Blocks held by running sequences, and held plus cached (evictable), as a share of the pool,
    over the sweep; each phase (baseline, each rate) shaded and labelled."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=90)
    samples = sampler.samples
    ts = [s.t_s for s in samples]
    used = [s.used_blocks / s.total_blocks * 100 for s in samples]
    held = [(s.used_blocks + s.cached_blocks) / s.total_blocks * 100 for s in samples]
    ax.plot(ts, used, lw=1.2, label="used by running sequences")
    ax.plot(ts, held, lw=0.8, ls="--", label="used + cached prefixes (evictable)")
    for i, (label, start, end) in enumerate(sampler.marks):
        ax.axvspan(start, end, color="grey", alpha=0.12 if i % 2 else 0.05, lw=0)
        ax.text((start + end) / 2, 1.0, label, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                fontsize=7)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV pool blocks (%)")
    ax.set_ylim(0, min(105.0, max(held) * 1.25 + 1))  # a full pool's 100% line stays visible
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=9, y=0.99)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
