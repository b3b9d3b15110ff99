"""Throughput and latency against concurrency for every server in a run, as a PNG (needs
matplotlib: pip install -e '.[bench]')."""

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
    # Levels where nothing completed have no figures to draw.
    servers = {label: [r for r in server["levels"] if r["completed"]] for label, server in results["servers"].items()}
    levels = sorted({r["concurrency"] for rows in servers.values() for r in rows})
    if not levels:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (label, rows) in zip(colors, servers.items()):
        draw_server(left, right, color, label, rows)
    if "baseline" in results:
        left.axhline(
            results["baseline"]["output_throughput"],
            color="grey",
            linestyle="--",
            label="transformers generate, 1 at a time",
        )
    label_axes(left, right, levels)
    shape = f"{results['input_len']} in / " if results.get("input_len") else ""
    fig.suptitle(
        f"{results['model']}, workload {results['workload']}: {shape}{results['output_len']} tokens out per request, {results['machine']['cpus']} CPUs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def draw_server(left, right, color: str, label: str, rows: list[dict]) -> None:
    """One server in one colour: throughput on the left; TTFT, TPOT and ITL p99 on the right, each its
    own marker and line style so the latencies stay apart when several servers share the axes."""
    x = [r["concurrency"] for r in rows]
    left.plot(x, [r["output_throughput"] for r in rows], "o-", color=color, label=label)
    for key, style, name in (
        ("median_ttft_ms", "o--", "TTFT median"),
        ("median_tpot_ms", "s-", "TPOT median"),
        ("p99_itl_ms", "^:", "ITL p99"),
    ):
        right.plot(x, [r[key] for r in rows], style, color=color, label=f"{label} {name}")


def label_axes(left, right, levels: list[int]) -> None:
    """Log-scaled concurrency with only the levels that ran as ticks (a log axis labels others too),
    and a log latency axis: TTFT and ITL differ by orders of magnitude."""
    from matplotlib.ticker import NullFormatter

    for axis, ylabel, title in (
        (left, "output tokens/s", "Throughput"),
        (right, "ms", "Latency"),
    ):
        axis.set(xscale="log", xlabel="concurrent streams", ylabel=ylabel, title=title)
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.xaxis.set_minor_formatter(NullFormatter())  # only the levels run are labelled
        axis.legend(fontsize="small")
    right.set_yscale("log")
