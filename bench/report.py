"""The printed results: one markdown table per run, each level's servers side by side, and the
ratios of the first server (ours) to each peer, so the table pastes into docs/benchmarks/ as it is."""

from __future__ import annotations

import math

from bench.stats import LATENCIES

THROUGHPUTS = ("request_throughput", "output_throughput", "total_token_throughput")
HEADER = [
    "server",
    "streams",
    "ok / errors",
    "req/s",
    "output tok/s",
    "total tok/s",
] + [f"{name.upper()} ms mean / median / p99" for name in LATENCIES]


def _number(value: float, suffix: str = "") -> str:
    if value is None or math.isnan(value):
        return "-"
    return (f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}") + suffix


def _cells(row: dict, suffix: str = "") -> list[str]:
    return [_number(row[key], suffix) for key in THROUGHPUTS] + [
        " / ".join(_number(row[f"{stat}_{name}_ms"], suffix) for stat in ("mean", "median", "p99"))
        for name in LATENCIES
    ]


def ratios(ours: list[dict], peer: list[dict]) -> list[dict]:
    """Ours divided by the peer's, level by level: above 1 is better for throughputs, below 1 for latencies."""
    by_level = {row["concurrency"]: row for row in peer}
    out = []
    for row in ours:
        other = by_level.get(row["concurrency"])
        if other is None:
            continue
        keys = list(THROUGHPUTS) + [f"{stat}_{name}_ms" for name in LATENCIES for stat in ("mean", "median", "p99")]
        out.append(
            {"concurrency": row["concurrency"]}
            | {k: round(row[k] / other[k], 2) if other[k] else float("nan") for k in keys}
        )
    return out


def table(servers: dict[str, list[dict]], ratio_rows: dict[str, list[dict]]) -> str:
    """``servers``: label -> level rows, ours first; ``ratio_rows``: peer label -> ratios()."""
    ours = next(iter(servers))
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    levels = sorted({row["concurrency"] for rows in servers.values() for row in rows})
    for level in levels:
        for label, rows in servers.items():
            for row in rows:
                if row["concurrency"] == level:
                    lines.append(
                        "| "
                        + " | ".join([label, str(level), f"{row['completed']} / {row['errors']}"] + _cells(row))
                        + " |"
                    )
        for label, rows in ratio_rows.items():
            for row in rows:
                if row["concurrency"] == level:
                    lines.append("| " + " | ".join([f"{ours} ÷ {label}", str(level), ""] + _cells(row, "x")) + " |")
    return "\n".join(lines)
