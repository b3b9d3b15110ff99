"""Drive the streaming chat API with N concurrent clients and time every chunk."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson


@dataclass(slots=True)
class RequestTiming:
    start: float
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    completion_tokens: int = 0  # from the usage chunk, else the content chunks
    prompt_tokens: int = 0  # from the usage chunk (0 when the server sends none)
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
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # A chunk holding several tokens (a character split over tokens) counts as several equal gaps.
        return gaps if len(gaps) == self.completion_tokens - 1 else [per_token] * (self.completion_tokens - 1)


async def _read_chunked(reader: asyncio.StreamReader):
    """The body of a ``Transfer-Encoding: chunked`` response, chunk by chunk."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def one_request(host: str, port: int, body: bytes) -> RequestTiming:
    """One streamed chat completion over a fresh connection, timed chunk by chunk.

    A deliberately lean client (raw HTTP/1.1, SSE events spotted by their bytes, JSON parsed only
    for the usage chunk): with httpx the client used a whole core at 256 streams and measured itself.
    """
    timing = RequestTiming(start=time.perf_counter())
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200 or b"chunked" not in head.lower():
            timing.error = f"HTTP {status}: {(await reader.read(300))!r}"
            return timing
        pending = last = b""
        async for data in _read_chunked(reader):
            pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                event = event.split(b"\n", 1)[1] if event.startswith(b"id: ") else event
                last = event if event != b"data: [DONE]" else last
                if b'"delta":{"content":"' in event and b'"delta":{"content":""' not in event:
                    now = time.perf_counter()
                    timing.first_token = timing.first_token or now
                    timing.chunk_times.append(now)
                elif event.startswith(b'data: {"error"'):
                    timing.error = orjson.loads(event[6:])["error"]["message"]
                elif b'"usage":{' in event:
                    usage = orjson.loads(event[6:])["usage"]
                    timing.completion_tokens, timing.prompt_tokens = (
                        usage["completion_tokens"],
                        usage["prompt_tokens"],
                    )
        if not timing.completion_tokens:  # no usage reported: one token per chunk
            timing.completion_tokens = len(timing.chunk_times)
        if not timing.chunk_times and timing.error is None:  # an error in a shape not known here
            timing.error = f"no content streamed; last event {(last or pending)[:300]!r}"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        timing.end = time.perf_counter()  # on the early return of an HTTP error too
        if writer is not None:
            writer.close()
    return timing


def request_body(model: str, prompt: str, max_tokens: int, system: str | None = None) -> bytes:
    system_message = [{"role": "system", "content": system}] if system is not None else []
    return orjson.dumps(
        {
            "model": model,
            "messages": [*system_message, {"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,  # fixed output length: every server generates the same amount
            "temperature": 0.8,
        }
    )


async def run_level(
    base_url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    requests: int,
    max_tokens: int,
    system: str | None = None,
) -> tuple[list[RequestTiming], float]:
    """``requests`` requests, at most ``concurrency`` at a time (each with the ``system`` message
    first, when given); returns timings and wall time."""
    bodies = [request_body(model, p, max_tokens, system) for p in prompts]
    return await run_bodies(base_url, bodies, concurrency, requests)


async def run_bodies(
    base_url: str, bodies: list[bytes], concurrency: int, requests: int
) -> tuple[list[RequestTiming], float]:
    """``requests`` chat bodies (taken in turn), at most ``concurrency`` at a time; timings and wall time."""
    url = urlsplit(base_url)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    timings: list[RequestTiming] = []

    async def client_loop() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            timings.append(await one_request(url.hostname, url.port or 80, bodies[i % len(bodies)]))

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return timings, time.perf_counter() - start
