"""Drive the streaming chat API with N concurrent clients and time every chunk."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import orjson


@dataclass(slots=True)
class RequestTiming:
    start: float
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return (self.first_token or self.end) - self.start

    @property
    def inter_token(self) -> list[float]:
        """Gaps between content chunks, spread over the tokens each chunk carried."""
        times = self.chunk_times
        if len(times) < 2 or self.completion_tokens < 2:
            return []
        per_token = (times[-1] - times[0]) / (self.completion_tokens - 1)
        gaps = [b - a for a, b in zip(times, times[1:])]
        # A chunk holding several tokens (a character split over tokens) counts as several equal gaps.
        return gaps if len(gaps) == self.completion_tokens - 1 else [per_token] * (self.completion_tokens - 1)


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> RequestTiming:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # fixed output length: every server generates the same amount
        "temperature": 0.8,
    }
    timing = RequestTiming(start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    timing.error = chunk["error"]["message"]
                    break
                if chunk.get("usage"):
                    timing.completion_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0]["delta"].get("content"):
                    now = time.perf_counter()
                    timing.first_token = timing.first_token or now
                    timing.chunk_times.append(now)
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.end = time.perf_counter()
    return timing


async def run_level(base_url: str, model: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int) -> tuple[list[RequestTiming], float]:
    """``requests`` requests, at most ``concurrency`` at a time; returns timings and wall time."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)
        timings: list[RequestTiming] = []

        async def client_loop() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                timings.append(await one_request(client, url, model, prompts[i % len(prompts)], max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return timings, time.perf_counter() - start
