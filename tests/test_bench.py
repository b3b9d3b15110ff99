"""The benchmark's own arithmetic and inputs, without a model server: vLLM-named metrics from known
timings, the streaming client against a stream in llama-server's exact bytes, prompts of exact
token counts, peers and the comparison table."""

from __future__ import annotations

import asyncio
import math

import httpx
import orjson
import pytest

from bench import workloads
from bench.load import RequestTiming, run_level
from bench.report import ratios, table
from bench.servers import parse_peer
from bench.stats import percentile, summarize


def timing(start: float, chunks: list[float], end: float, tokens: int, prompt: int = 100) -> RequestTiming:
    return RequestTiming(
        start=start,
        first_token=chunks[0],
        chunk_times=chunks,
        end=end,
        completion_tokens=tokens,
        prompt_tokens=prompt,
    )


def test_percentile_interpolates_like_numpy():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_summarize_uses_vllm_definitions():
    # Two requests over a 2 s level: 4 tokens in 0.1 s gaps after a 0.2 s TTFT, and 3 tokens
    # after 0.5 s with 0.25 s gaps; one failed request counts as an error, not in the figures.
    a = timing(0.0, [0.2, 0.3, 0.4, 0.5], 0.5, 4)
    b = timing(1.0, [1.5, 1.75, 2.0], 2.0, 3, prompt=50)
    failed = RequestTiming(start=0.0, end=0.1, error="HTTP 500")
    row = summarize(2, [a, b, failed], 2.0)
    assert (row["completed"], row["errors"], row["first_error"]) == (2, 1, "HTTP 500")
    assert row["request_throughput"] == 1.0
    assert row["output_throughput"] == 3.5
    assert row["total_token_throughput"] == (150 + 7) / 2
    assert (row["mean_ttft_ms"], row["median_ttft_ms"]) == (350.0, 350.0)
    assert row["p99_ttft_ms"] == pytest.approx(497.0)
    # TPOT: (e2el - ttft) / (tokens - 1) = 0.3/3 and 0.5/2
    assert row["mean_tpot_ms"] == pytest.approx(175.0)
    # ITL: three gaps of 100 ms and two of 250 ms
    assert row["mean_itl_ms"] == pytest.approx(160.0)
    assert row["median_itl_ms"] == pytest.approx(100.0)
    assert row["median_e2el_ms"] == pytest.approx(750.0)


def test_a_chunk_of_several_tokens_counts_as_equal_gaps():
    t = timing(0.0, [0.1, 0.4], 0.4, 4)  # 4 tokens in 2 chunks: 3 gaps of 0.1 s
    assert t.inter_token == pytest.approx([0.1, 0.1, 0.1])


LLAMA_SERVER_EVENTS = [
    {
        "choices": [
            {
                "delta": {"content": None, "role": "assistant"},
                "finish_reason": None,
                "index": 0,
            }
        ],
        "object": "chat.completion.chunk",
    },
    *(
        {
            "choices": [{"delta": {"content": word}, "finish_reason": None, "index": 0}],
            "object": "chat.completion.chunk",
        }
        for word in ["Hello", " there", ""]
    ),
    {
        "choices": [{"delta": {}, "finish_reason": "length", "index": 0}],
        "object": "chat.completion.chunk",
    },
    {
        "choices": [],
        "object": "chat.completion.chunk",
        "timings": {"predicted_n": 3},
        "usage": {"completion_tokens": 3, "prompt_tokens": 31, "total_tokens": 34},
    },
]


async def _stream_server(events: list[dict], bodies: list[dict]) -> asyncio.Server:
    """A one-route HTTP server streaming ``events`` as SSE in chunked encoding, as llama-server does."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1]
        )
        bodies.append(orjson.loads(await reader.readexactly(length)))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for payload in [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]:
            writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _run_against(events: list[dict]) -> tuple[list[RequestTiming], list[dict]]:
    async def main():
        bodies: list[dict] = []
        server = await _stream_server(events, bodies)
        port = server.sockets[0].getsockname()[1]
        async with server:
            timings, _ = await run_level(f"http://127.0.0.1:{port}", "m", ["a", "b", "c"], 2, 3, 7)
        return timings, bodies

    return asyncio.run(main())


def test_client_reads_llama_server_stream():
    timings, bodies = _run_against(LLAMA_SERVER_EVENTS)
    assert len(timings) == 3 and all(t.error is None for t in timings)
    for t in timings:
        assert (t.completion_tokens, t.prompt_tokens, len(t.chunk_times)) == (
            3,
            31,
            2,
        )  # empty content is no token
    assert {b["messages"][0]["content"] for b in bodies} == {"a", "b", "c"}
    assert all(
        b["max_tokens"] == 7 and b["ignore_eos"] and b["stream_options"] == {"include_usage": True} for b in bodies
    )


def test_client_counts_chunks_when_the_server_reports_no_usage():
    timings, _ = _run_against(LLAMA_SERVER_EVENTS[:-1])
    assert [(t.completion_tokens, t.prompt_tokens) for t in timings] == [(2, 0)] * 3


def test_a_stream_without_content_is_an_error():
    timings, _ = _run_against([{"error": {"code": 500, "message": "boom"}}])  # OpenAI's shape
    assert [t.error for t in timings] == ["boom"] * 3
    timings, _ = _run_against([{"detail": "bust"}])  # any other
    assert all(t.error.startswith("no content streamed") and "bust" in t.error for t in timings)


def test_random_prompts_have_exact_token_counts_and_are_unique(tokenizer):
    work = workloads.build("random", [1, 2], None, 16, 300, tokenizer, seed=1)
    prompts = [p for level in (1, 2) for p in work.levels[level]]
    assert [len(work.levels[level]) for level in (1, 2)] == [4, 4]
    assert all(workloads.prompt_tokens(tokenizer, p) == 300 for p in prompts)
    assert len({" ".join(p.split()[:4]) for p in prompts}) == len(prompts)  # no shared prefix
    assert workloads.build("random", [1, 2], None, 16, 300, tokenizer, seed=1) == work  # same seed, same prompts


def test_long_context_defaults_and_chat_cycles_fixed_prompts(tokenizer):
    long = workloads.build("long-context", [1], 2, 8, None, tokenizer)
    assert long.input_len == 4096 and len(long.levels[1]) == 2
    assert all(workloads.prompt_tokens(tokenizer, p) == 4096 for p in long.levels[1])
    chat = workloads.build("chat", [1, 32], None, 128, None)
    assert len(chat.levels[1]) == 4 and len(chat.levels[32]) == 64 and chat.levels[32][16] == chat.levels[32][0]
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.build("bogus", [1], None, 8, None, tokenizer)


def test_agent_turns_share_one_long_system_prompt(tokenizer):
    agent = workloads.build("agent", [1], 3, 8, 600, tokenizer, seed=2)
    assert 590 <= len(tokenizer.encode(agent.system)) <= 600 and '"type": "function"' in agent.system
    turns = agent.levels[1]
    assert len(set(turns)) == 3 and all(len(tokenizer.encode(t)) < 40 for t in turns)
    assert workloads.build("agent", [1], 3, 8, 600, tokenizer, seed=3).system != agent.system


def test_parse_peer():
    assert parse_peer("llama.cpp=http://127.0.0.1:8081/v1/").label == "llama.cpp"
    assert parse_peer("llama.cpp=http://127.0.0.1:8081/v1/").url == "http://127.0.0.1:8081"
    assert parse_peer("http://127.0.0.1:8081").label == "127.0.0.1:8081"
    with pytest.raises(ValueError):
        parse_peer("127.0.0.1:8081")


def test_table_puts_servers_side_by_side_with_ratios():
    ours = [summarize(1, [timing(0.0, [0.1, 0.2], 0.2, 2)], 1.0)]
    peer = [summarize(1, [timing(0.0, [0.2, 0.4], 0.4, 2)], 2.0)]
    found = ratios(ours, peer)
    assert found[0]["output_throughput"] == 2.0 and found[0]["median_ttft_ms"] == 0.5
    lines = table({"llmpool": ours, "llama.cpp": peer}, {"llama.cpp": found}).splitlines()
    assert lines[2].startswith("| llmpool | 1 |") and lines[3].startswith("| llama.cpp | 1 |")
    assert lines[4].startswith("| llmpool ÷ llama.cpp | 1 |") and "| 2x |" in lines[4]


def test_a_fleet_process_registers_many_workers_with_every_gateway(tmp_path):
    """bench/fake_worker.py --count: 8 simulated workers in one process, each registered with both
    of two real gateways, answer requests through either."""
    from tests.conftest import free_port, spawn, stop, wait_until, worker_argv

    gateways = [(free_port(), free_port()) for _ in range(2)]
    processes = [
        spawn(["gateway", "--port", str(http), "--zmq-bind", f"tcp://127.0.0.1:{zmq}"], f"fleet-gateway-{i}")
        for i, (http, zmq) in enumerate(gateways)
    ]
    addresses = ",".join(f"tcp://127.0.0.1:{zmq}" for _, zmq in gateways)
    fleet = worker_argv(addresses, "sim", "--count", "8", fake_info=tmp_path / "model-info")
    processes.append(spawn(fleet, "fleet-workers"))
    try:
        for http, _ in gateways:
            url = f"http://127.0.0.1:{http}"
            wait_until(
                lambda url=url: len(httpx.get(url + "/workers", timeout=5).json()["workers"]) == 8,
                120,
                "8 simulated workers",
            )
            names = {w["name"] for w in httpx.get(url + "/workers", timeout=5).json()["workers"]}
            assert names == {f"sim-{i}" for i in range(8)}
            body = {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "ignore_eos": True,
            }
            reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()
            assert reply["usage"]["completion_tokens"] == 5 and reply["choices"][0]["finish_reason"] == "length"
    finally:
        for process in reversed(processes):
            stop(process)
