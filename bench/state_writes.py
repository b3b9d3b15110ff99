"""The state store's writes alone, on a SQLite file and on a PostgreSQL server (fsync on):

- a final write (one ~4 KB response row, committed alone): what a client waits for after its last token;
- the event log at 64 streams: events handed to the writer (a list append on the token path) and the
  group commits that take them (64 streams x 30 events per 0.1 s, 5 s).

    python -m bench.state_writes
"""

from __future__ import annotations

import asyncio
import statistics
import time

import msgspec

from gateway.state.records import ResponseRecord
from gateway.state.store import Limits, StateStore


def _record(i: int) -> ResponseRecord:
    body = msgspec.json.encode({"id": f"r{i}", "output": [{"type": "message", "content": [{"text": "word " * 700}]}]})
    return ResponseRecord(f"r{i}", "owner", int(time.time()), "m", "completed", body, b"[]", b"[]")


async def measure(url: str) -> dict:
    store = await StateStore.open(url, Limits())
    latencies = []
    for i in range(200):
        began = time.perf_counter()
        await store.writer.final(_record(i))
        latencies.append(time.perf_counter() - began)
    event = b'{"type":"response.output_text.delta","sequence_number":1,"item_id":"msg_x","output_index":0,"content_index":0,"delta":" word","logprobs":[]}'
    commits, busy = store.writer.commits, store.writer.busy_s
    append_s, events = 0.0, 0
    began = time.perf_counter()
    while time.perf_counter() - began < 5:
        t = time.perf_counter()
        for stream in range(64):
            for seq in range(30):
                store.writer.event(f"s{stream}", events + seq, event)
        append_s += time.perf_counter() - t
        events += 30
        await asyncio.sleep(0.1)
    await store.writer.sync()
    total = 64 * events
    result = {
        "final_write_p50_ms": 1000 * statistics.median(latencies),
        "final_write_p99_ms": 1000 * sorted(latencies)[int(0.99 * len(latencies)) - 1],
        "events": total,
        "append_us_per_event": 1e6 * append_s / total,
        "commits": store.writer.commits - commits,
        "commit_ms_per_event": 1000 * (store.writer.busy_s - busy) / total,
        "events_per_s": total / (time.perf_counter() - began),
    }
    await store.close()
    return result


def main() -> None:
    from tests.postgres import Postgres

    postgres = Postgres(durable=True)
    try:
        for name, url in (
            ("sqlite", f"sqlite:///{postgres.folder}/writes.db"),
            ("postgresql", postgres.database("writes")),
        ):
            print(
                name,
                {k: round(v, 3) if isinstance(v, float) else v for k, v in asyncio.run(measure(url)).items()},
                flush=True,
            )
    finally:
        postgres.stop()


if __name__ == "__main__":
    main()
