"""The gateway's routing cost, in-process (bench/fleet.py's first figure): what the WorkerClient spends
per request choosing a worker and queuing the request (``submit`` + the tick's ``_flush``) against N
registered workers (real DEALER sockets), in µs; with the cost of handling one worker heartbeat and
of sending one. Apart from bench/fleet.py, which starts processes, because this part starts none."""

from __future__ import annotations

import asyncio
import cProfile
import functools
import inspect
import io
import pstats
import random
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable
from statistics import median

import msgspec
import zmq

from common import protocol
from common.model_source import DEFAULT_MODEL
from common.protocol import DescribeModel, Heartbeat, ModelInfo, NewRequest, Ready, SamplingParams


def _ready(name: str) -> Ready:
    return Ready(name, DEFAULT_MODEL, 8192, 10**7, 16, 4096, "none", "none", tokenizer_digest="bench")


def _answer_describe(dealers: list[zmq.Socket]) -> None:
    """A gateway that learns tokenizers from its workers asks one for it: answer with an empty one
    (a bare WorkerClient has nothing to load it into) so the workers that wait on it are admitted."""
    for sock in dealers:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if isinstance(protocol.decode(frames), DescribeModel):
                sock.send_multipart(
                    protocol.encode(ModelInfo(DEFAULT_MODEL, "bench", zlib.compress(msgspec.msgpack.encode({}))))
                )


async def routing_cost(
    workers: int, requests: int, batch: int, prompt_len: int, profile: cProfile.Profile | None = None
) -> dict:
    """CPU µs per request of ``submit`` + ``_flush`` with ``workers`` registered, ``batch`` submits per
    loop tick, and of the HTTP side's ``limits()``; CPU µs to handle one worker heartbeat (receive,
    decode, dispatch) and to send one."""
    address = f"ipc://{tempfile.gettempdir()}/llmpool-fleet-{uuid.uuid4().hex[:8]}"
    client, submit, limits = _client(address)
    await client.start()
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, workers + 64)
    dealers: list[zmq.Socket] = []
    try:
        await _register(client, context, address, workers, dealers)
        receive_us, send_us = await heartbeat_cost(client, dealers)
        per_request = await _submit_cost(client, submit, dealers, _requests(requests, prompt_len), batch, profile)
        return {
            "workers": workers,
            "batch": batch,
            "requests": requests,
            "prompt_tokens": prompt_len,
            "routing_us_median": round(median(per_request), 2),
            "routing_us_mean": round(sum(per_request) / len(per_request), 2),
            "limits_us": round(_limits_cost(limits), 2),
            "heartbeat_receive_us": round(receive_us, 2),
            "heartbeat_send_us": round(send_us, 2),
        }
    finally:
        for sock in dealers:
            sock.close()
        context.term()
        await client.stop()


def _client(address: str) -> tuple:
    """A bare WorkerClient bound to ``address``, with its ``submit`` and ``limits`` taking one argument
    whichever gateway this is: single-model gateways take the model at construction, multi-model
    ones with each call (so the same bench measures the code before and after that change)."""
    from gateway.fleet.worker_client import WorkerClient

    single_model = "model" in inspect.signature(WorkerClient).parameters
    client = WorkerClient(
        address, **({"model": DEFAULT_MODEL} if single_model else {}), heartbeat_interval=3600, heartbeat_liveness=5
    )
    if single_model:
        return client, client.submit, client.limits
    submit = functools.partial(lambda new, submit: submit(new, DEFAULT_MODEL), submit=client.submit)
    return client, submit, functools.partial(client.limits, DEFAULT_MODEL)


async def _register(client, context: zmq.Context, address: str, workers: int, dealers: list[zmq.Socket]) -> None:
    """``workers`` DEALER sockets, each a worker announcing itself, until the client lists them all;
    each goes into ``dealers`` as soon as it is open, so the caller closes it whatever happens."""
    for i in range(workers):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"sim-{i}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send_multipart(protocol.encode(_ready(f"sim-{i}")))
        dealers.append(sock)
    deadline = time.monotonic() + 60
    while len(client.workers) < workers and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        _answer_describe(dealers)
    if len(client.workers) < workers:
        raise RuntimeError(f"only {len(client.workers)} of {workers} workers registered")


def _requests(requests: int, prompt_len: int) -> list[NewRequest]:
    """Sampled requests with random prompts, the same every run (seed 0)."""
    rng = random.Random(0)
    return [
        NewRequest(f"r{i}", [rng.randrange(1000, 40000) for _ in range(prompt_len)], 8, SamplingParams(temperature=0.8))
        for i in range(requests)
    ]


async def _submit_cost(
    client, submit: Callable, dealers: list[zmq.Socket], news: list[NewRequest], batch: int, profile
) -> list[float]:
    """CPU µs per request of each group of ``batch`` submits and the flush after them; only that is
    timed (and profiled), not ending the streams nor the loop's turns in between."""
    per_request = []
    for start in range(0, len(news), batch):
        group = news[start : start + batch]
        if profile is not None:
            profile.enable()
        t0 = time.thread_time_ns()  # CPU time of this thread: the other processes on the machine don't count
        streams = [submit(new) for new in group]
        client._flush()
        elapsed = time.thread_time_ns() - t0
        if profile is not None:
            profile.disable()
        per_request.append(elapsed / 1000 / len(group))
        for stream in streams:  # finish them, so load stays as at a steady state
            client.dispatch.end(stream)
        if start // batch % 64 == 63:
            await asyncio.sleep(0)  # let the loop run (send futures, the scheduled flush)
            _drain(dealers)
    _drain(dealers)
    return per_request


def _limits_cost(limits: Callable[[], object], calls: int = 1000) -> float:
    """CPU µs per ``limits()`` call: the HTTP side asks for the workers' limits on every request too
    (twice for a chat request)."""
    t0 = time.thread_time_ns()
    for _ in range(calls):
        limits()
    return (time.thread_time_ns() - t0) / 1000 / calls


async def heartbeat_cost(client, dealers: list[zmq.Socket], rounds: int = 5) -> tuple[float, float]:
    """CPU µs of this (the event loop's) thread per worker heartbeat received through the socket
    (zmq.asyncio receive, decode, dispatch) and per gateway heartbeat sent (encoded once, ``_send``)."""
    infos = list(client.workers.values())
    beat = protocol.encode(Heartbeat(running=3, free_blocks=600_000, total_blocks=625_000, steps=10, tokens_per_s=50.0))
    target = sum(w.heartbeats for w in infos) + rounds * len(dealers)
    for _ in range(rounds):
        for sock in dealers:
            sock.send_multipart(beat)
    start = time.thread_time()
    deadline = time.monotonic() + 60
    while sum(w.heartbeats for w in infos) < target and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    receive_us = (time.thread_time() - start) * 1e6 / (rounds * len(dealers))
    start = time.thread_time()
    for _ in range(rounds):
        for info in infos:
            client._send(info.identity, protocol.encode(Heartbeat()))
        await asyncio.sleep(0)  # the send futures' callbacks
    send_us = (time.thread_time() - start) * 1e6 / (rounds * len(infos))
    _drain(dealers)
    return receive_us, send_us


def _drain(dealers: list[zmq.Socket]) -> None:
    for sock in dealers:
        while True:
            try:
                sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break


def profile_top(profile: cProfile.Profile, lines: int = 12) -> list[str]:
    """The functions that took the most time of their own, one line each."""
    stream = io.StringIO()
    pstats.Stats(profile, stream=stream).sort_stats("tottime").print_stats(lines)
    rows = [row.strip() for row in stream.getvalue().splitlines()]
    start = next(i for i, row in enumerate(rows) if row.startswith("ncalls"))
    return [row for row in rows[start : start + 1 + lines] if row]
