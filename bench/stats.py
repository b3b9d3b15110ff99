"""Summaries of one concurrency level: medians and p99s (these machines are noisy)."""

from __future__ import annotations

import statistics

from bench.load import RequestTiming


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summarize(concurrency: int, timings: list[RequestTiming], wall_s: float) -> dict:
    ok = [t for t in timings if t.error is None]
    tokens = sum(t.completion_tokens for t in ok)
    ttft = [t.ttft for t in ok]
    itl = [gap for t in ok for gap in t.inter_token]
    e2e = [t.end - t.start for t in ok]
    return {
        "concurrency": concurrency,
        "requests": len(timings),
        "errors": len(timings) - len(ok),
        "first_error": next((t.error for t in timings if t.error), None),
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s else 0.0,
        "per_stream_tokens_per_s": round(statistics.median(
            [(t.completion_tokens - 1) / (t.chunk_times[-1] - t.chunk_times[0]) for t in ok if len(t.chunk_times) > 1 and t.completion_tokens > 1]
            or [float("nan")]), 1),
        "ttft_p50_s": round(percentile(ttft, 50), 4),
        "ttft_p99_s": round(percentile(ttft, 99), 4),
        "itl_p50_ms": round(percentile(itl, 50) * 1000, 2),
        "itl_p99_ms": round(percentile(itl, 99) * 1000, 2),
        "e2e_p50_s": round(percentile(e2e, 50), 3),
        "e2e_p99_s": round(percentile(e2e, 99), 3),
    }
