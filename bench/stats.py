"""Summaries of one concurrency level, with ``vllm bench serve``'s metric names and definitions.

Throughputs are over the level's wall time; TTFT is request start to first content chunk; TPOT is
a request's time after its first token divided by its other tokens; ITL is every gap between
content chunks (a chunk carrying several tokens counts as that many equal gaps); E2EL is request
start to its last byte. Each latency gets its mean, median and p99, in milliseconds.
"""

from __future__ import annotations

import statistics

from bench.load import RequestTiming

LATENCIES = ("ttft", "tpot", "itl", "e2el")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default, as vLLM reports)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _described(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        f"mean_{name}_ms": round(statistics.fmean(ms), 2) if ms else float("nan"),
        f"median_{name}_ms": round(percentile(ms, 50), 2),
        f"p99_{name}_ms": round(percentile(ms, 99), 2),
    }


def summarize(concurrency: int, timings: list[RequestTiming], wall_s: float) -> dict:
    ok = [t for t in timings if t.error is None]
    output = sum(t.completion_tokens for t in ok)
    prompt = sum(t.prompt_tokens for t in ok)
    samples = {
        "ttft": [t.ttft for t in ok],
        "tpot": [(t.end - t.start - t.ttft) / (t.completion_tokens - 1) for t in ok if t.completion_tokens > 1],
        "itl": [gap for t in ok for gap in t.inter_token],
        "e2el": [t.end - t.start for t in ok],
    }
    row = {
        "concurrency": concurrency,
        "requests": len(timings),
        "completed": len(ok),
        "errors": len(timings) - len(ok),
        "first_error": next((t.error for t in timings if t.error), None),
        "duration": round(wall_s, 3),  # seconds, as vLLM names it
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": round(len(ok) / wall_s, 3) if wall_s else 0.0,
        "output_throughput": round(output / wall_s, 1) if wall_s else 0.0,
        "total_token_throughput": round((prompt + output) / wall_s, 1) if wall_s else 0.0,
    }
    for name in LATENCIES:
        row |= _described(name, samples[name])
    return row
