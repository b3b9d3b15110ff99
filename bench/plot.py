"""Throughput and latency against concurrency, as a PNG (needs matplotlib: pip install -e '.[bench]')."""

from __future__ import annotations

from pathlib import Path


def plot(results: dict, path: Path) -> bool:
    """Write the plot; False (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = results["levels"]
    levels = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(levels, [r["tokens_per_s"] for r in rows], "o-", label="llmpool (HTTP, streaming)")
    if "baseline" in results:
        left.axhline(results["baseline"]["tokens_per_s"], color="grey", linestyle="--", label="transformers generate, 1 at a time")
    left.set(xscale="log", xlabel="concurrent streams", ylabel="output tokens/s", title="Throughput")
    left.set_xticks(levels, [str(c) for c in levels])
    left.legend()
    right.plot(levels, [r["ttft_p50_s"] * 1000 for r in rows], "o-", label="TTFT p50")
    right.plot(levels, [r["ttft_p99_s"] * 1000 for r in rows], "o--", label="TTFT p99")
    right.plot(levels, [r["itl_p50_ms"] for r in rows], "s-", label="inter-token p50")
    right.plot(levels, [r["itl_p99_ms"] for r in rows], "s--", label="inter-token p99")
    right.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms", title="Latency")
    right.set_xticks(levels, [str(c) for c in levels])
    right.legend()
    fig.suptitle(f"{results['model']}, {results['max_tokens']} tokens per request, {results['machine']['cpus']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
