"""Scheduling behaviour seen from the API: chunked prefill under load, preemption when KV runs out."""

from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import MODEL, Server, start_serve, wait_until


async def _stream(client: httpx.AsyncClient, url: str, body: dict, times: list[float]) -> dict:
    """Stream a chat completion, appending the arrival time of every content chunk to ``times``."""
    usage: dict = {}
    async with client.stream(
        "POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
    return usage


@pytest.fixture(scope="module")
def one_worker(templating: Server) -> Server:
    """A server with one worker of the default model: the session's (tests/conftest.py ``templating``;
    a request's own template, which it allows, is not used here), not a launcher of its own."""
    return templating


def test_a_long_prompt_does_not_freeze_running_streams(one_worker):
    """A 2,000-token prompt arrives while 16 streams decode: while it is prefilled (about 2 s here,
    in 64-token chunks beside the decode rows), their inter-token p99 stays under an eighth of that
    prefill's duration, so no stream waits for the whole prefill.

    The bound is relative to the prefill, not to the median gap: both shrink and grow with the
    machine, but a step carrying a chunk takes 3-7x a decode-only step (9-16 ms vs 44-67 ms in the
    C++ step), which put a median-relative bound (5x) within noise of a busy 2-core machine."""
    url = one_worker.base_url + "/v1/chat/completions"

    async def scenario() -> tuple[list[list[float]], tuple[float, float], dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            times: list[list[float]] = [[] for _ in range(16)]
            streams = [
                asyncio.create_task(
                    _stream(
                        client,
                        url,
                        {
                            "model": MODEL,
                            "messages": [{"role": "user", "content": f"Tell story number {i}."}],
                            "max_tokens": 160,
                            "ignore_eos": True,
                            "temperature": 0.8,
                        },
                        times[i],
                    )
                )
                for i in range(16)
            ]
            while min(len(t) for t in times) < 20:  # everyone is decoding
                await asyncio.sleep(0.05)
            start = time.perf_counter()
            long_usage = await _stream(
                client,
                url,
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "word " * 1990}],
                    "max_tokens": 1,
                },
                [],
            )
            window = (start, time.perf_counter())
            await asyncio.gather(*streams)
            return times, window, long_usage

    def p99_and_prefill() -> tuple[float, float]:
        times, (start, end), long_usage = asyncio.run(scenario())
        assert long_usage["prompt_tokens"] >= 2000
        gaps = [(b, b - a) for t in times for a, b in zip(t, t[1:])]
        median = statistics.median(g for _, g in gaps)
        during = sorted(g for at, g in gaps if start <= at <= end + median)
        assert len(during) > 16, "the long prompt should take several steps to prefill"
        return during[min(len(during) - 1, round(0.99 * (len(during) - 1)))], end - start

    # One stall of this shared 2-core machine hits all 16 streams at once and so the p99: a noisy
    # first measurement is repeated once; the bound is the same for both.
    attempts = [p99_and_prefill()]
    if attempts[0][0] > attempts[0][1] / 8:
        attempts.append(p99_and_prefill())
    p99, prefill = attempts[-1]
    assert p99 <= prefill / 8, "inter-token p99 vs the prefill's duration, per attempt: " + ", ".join(
        f"{p * 1000:.0f} ms vs {d * 1000:.0f} ms" for p, d in attempts
    )


def test_oversubscribed_kv_cache_preempts_and_every_answer_is_still_right():
    """A KV cache that holds ~2 requests' worth of tokens, 6 requests at once: requests are preempted
    and recomputed, and each greedy answer equals the answer it gets alone (float32: exact)."""
    server = start_serve("serve-preempt", 1, "--dtype", "float32", "--kv-cache-memory", "8MiB", "--block-size", "16")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        prompts = [f"Write a few sentences about the number {i}." for i in range(6)]

        def ask(prompt: str) -> str:
            reply = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=24,  # ~70 tokens a request: 6 at once want ~30 blocks of the 11 the cache has
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return reply.choices[0].message.content

        alone = [ask(p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(ask, prompts))
        assert together == alone
        seen = server.workers()[0]["heartbeats"]
        wait_until(lambda: server.workers()[0]["heartbeats"] > seen, 10, "a fresh load report")
        worker = server.workers()[0]
        assert worker["kv_capacity_tokens"] < 6 * 100, worker
        assert worker["preemptions"] > 0, "the workload should have oversubscribed the cache"
    finally:
        server.stop()


def test_a_repeated_long_system_prompt_is_served_from_the_prefix_cache(one_worker):
    """Same ~1,000-token system prompt, new question: the second request's prompt mostly comes from
    the KV cache (reported as cached_tokens, and counted by the worker as prefix hits). How much
    sooner its first token comes is the benchmark's to measure (a speed figure, printed here)."""
    client = openai.OpenAI(base_url=one_worker.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    system = "You are a meticulous assistant. " + " ".join(
        f"Rule {i}: answer carefully and politely." for i in range(120)
    )

    def first_token_time(question: str) -> tuple[float, dict]:
        start = time.perf_counter()
        first = None
        usage = None
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            usage = chunk.usage or usage
        return first, usage.model_dump()

    cold, cold_usage = first_token_time("What is rule 7?")
    warm, warm_usage = first_token_time("What is rule 8?")
    assert cold_usage["prompt_tokens"] >= 1000
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] < 100
    assert warm_usage["prompt_tokens_details"]["cached_tokens"] >= 960
    print(f"\nprefix cache: cold TTFT {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms")
    seen = one_worker.workers()[0]["heartbeats"]
    wait_until(lambda: one_worker.workers()[0]["heartbeats"] > seen, 10, "a fresh load report")
    assert one_worker.workers()[0]["prefix_hit_tokens"] >= 960


def _shared_prompt_run(server: Server, tag: str) -> tuple[float, int]:
    """Three system prompts of ~370 tokens (new to ``server``: ``tag`` is in their first tokens), each used by
    four requests (interleaved), on two workers: returns (mean TTFT, requests that found their
    prompt cached)."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    systems = [
        f"You are assistant {tag} {k}. " + " ".join(f"Rule {i}: be helpful in way {k}." for i in range(30))
        for k in range(3)
    ]
    ttfts, cached = [], 0
    for turn in range(4):
        for k, system in enumerate(systems):
            start = time.perf_counter()
            first = None
            usage = None
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Question {turn}?"}],
                max_tokens=2,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if (
                    first is None
                    and chunk.choices
                    and chunk.choices[0].delta.content is not None
                    and chunk.choices[0].delta.content
                ):
                    first = time.perf_counter() - start
                usage = chunk.usage or usage
            ttfts.append(first if first is not None else time.perf_counter() - start)
            cached += (
                usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 32
            )  # all but the question's blocks
    return statistics.mean(ttfts), cached


def test_prefix_affinity_routes_shared_prompts_to_their_cache(server: Server):
    """With affinity (the shared server: two workers, the default slack) against a server started
    with it off."""
    hits = server.get("/workers").json()["affinity_hits"]
    on_ttft, on_cached = _shared_prompt_run(server, "alpha")
    hits = server.get("/workers").json()["affinity_hits"] - hits
    off = start_serve("serve-affinity-off", 2, "--prefix-affinity-slack", "-1")
    try:
        off_ttft, off_cached = _shared_prompt_run(off, "beta")
    finally:
        off.stop()
    print(
        f"\nprefix affinity: mean TTFT {on_ttft * 1000:.0f} ms with, {off_ttft * 1000:.0f} ms without; "
        f"cached prompts {on_cached}/12 with, {off_cached}/12 without; {hits} requests moved to their prefix's worker"
    )
    assert on_cached == 9, "with affinity only each prompt's first use is cold"
    assert hits > 0, "least-loaded routing alone would have sent some of them elsewhere"
    assert off_cached < on_cached  # the TTFTs (printed) are a speed figure: the benchmark's
