"""Files and batches in the state store, on a SQLite file and a real PostgreSQL server: two gateways
(two connections, two gateway ids) claim one batch's requests at once without sharing one; a result
from a claim that was taken back (its gateway's lease ran out) is refused, so each line is written
once; and a batch ends completed, expired or cancelled with OpenAI's output and error files."""

from __future__ import annotations

import asyncio
import time

import msgspec

from gateway.batch.lines import parse_input
from gateway.state.batches import EXPIRED, Batches
from gateway.state.db import connect
from gateway.state.files import Files
from gateway.state.leases import Leases
from gateway.state.migrations import migrate
from tests.state.test_store import run

ENDPOINT = "/v1/chat/completions"


def jsonl(n: int) -> bytes:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": ENDPOINT, "body": {"model": "m", "messages": []}}
        for i in range(n)
    ]
    return b"\n".join(msgspec.json.encode(line) for line in lines) + b"\n"


async def gateway(state_url: str, name: str) -> tuple[Batches, Files, Leases]:
    db = await connect(state_url)
    _open.append(db)
    await migrate(db)
    files = Files(db)
    leases = Leases(db, name, lease_s=5.0)
    await leases.renew()
    return Batches(db, files, name), files, leases


_open: list = []


async def closing(scenario) -> None:
    try:
        await scenario
    finally:
        while _open:
            await _open.pop().close()


async def started(batches: Batches, files: Files, n: int) -> str:
    made = await files.create("k", "batch", "in.jsonl", jsonl(n))
    batch = await batches.create("k", made["id"], ENDPOINT, "24h", {"team": "eval"})
    assert batch["status"] == "validating" and batch["expires_at"] - batch["created_at"] == 86400
    lines, errors, model = parse_input(await files.content(made["id"], "k"), ENDPOINT)
    assert not errors and model == "m"
    assert await batches.start(batch["id"], lines, errors, model)
    assert not await batches.start(batch["id"], lines, errors, model), "a second start finds it in progress"
    return batch["id"]


def test_files_are_scoped_paged_and_deleted(url):
    async def scenario():
        _, files, _ = await gateway(url, "g1")
        made = [await files.create("k", "batch", f"f{i}.jsonl", b"x" * i) for i in range(3)]
        await files.create("other", "batch", "theirs.jsonl", b"y")
        page, more = await files.list("k", None, 2, None, ascending=False)
        assert [f["id"] for f in page] == [made[2]["id"], made[1]["id"]] and more
        page, more = await files.list("k", "batch", 2, page[-1]["id"], ascending=False)
        assert [f["id"] for f in page] == [made[0]["id"]] and not more
        assert await files.get(made[1]["id"], "other") is None and await files.content(made[1]["id"], "k") == b"x"
        assert await files.delete(made[1]["id"], "k") and not await files.delete(made[1]["id"], "k")

    run(closing(scenario()))


def test_two_gateways_claim_one_batch_without_sharing_a_request(url):
    async def scenario():
        (a, files, _), (b, _, _) = await gateway(url, "ga"), await gateway(url, "gb")
        batch_id = await started(a, files, 60)

        async def drain(batches: Batches) -> list[int]:
            got = []
            while claimed := await batches.claim(batch_id, "k", ENDPOINT, 4):
                for item in claimed:
                    assert await batches.finish(
                        item, msgspec.json.encode({"custom_id": item.custom_id}), False, (3, 1, 2, 0)
                    )
                got += [item.line for item in claimed]
            return got

        mine, theirs = await asyncio.gather(drain(a), drain(b))
        assert not set(mine) & set(theirs) and sorted(mine + theirs) == list(range(60))
        assert await a.unfinished(batch_id) == 0 and await b.finalize(batch_id, "completed", 5.0)
        assert not await a.finalize(batch_id, "completed", 5.0), "finalized once"
        done = await a.get(batch_id, "k")
        assert done["status"] == "completed" and done["request_counts"] == {"total": 60, "completed": 60, "failed": 0}
        assert done["usage"]["input_tokens"] == 180 and done["usage"]["input_tokens_details"]["cached_tokens"] == 60
        output = (await files.content(done["output_file_id"], "k")).splitlines()
        assert [msgspec.json.decode(line)["custom_id"] for line in output] == [f"r{i}" for i in range(60)]
        assert done["error_file_id"] is None and done["finalizing_at"] is not None

    run(closing(scenario()))


def test_a_dead_gateways_claims_run_again_elsewhere_and_its_late_results_are_refused(url):
    async def scenario():
        (a, files, _), (b, _, _) = await gateway(url, "dead"), await gateway(url, "alive")
        batch_id = await started(a, files, 3)
        (first, *_) = await a.claim(batch_id, "k", ENDPOINT, 3)
        assert await b.reclaim(5.0) == 0, "a live gateway keeps its claims"
        await a.db.execute("UPDATE gateways SET seen_at = ? WHERE id = 'dead'", time.time() - 60)
        assert await b.reclaim(5.0) == 3
        again = await b.claim(batch_id, "k", ENDPOINT, 3)
        assert [c.line for c in again] == [0, 1, 2]
        assert not await a.finish(first, b'{"late": true}', False, (1, 0, 1, 0)), "the old claim writes nothing"
        for item in again:
            assert await b.finish(
                item, msgspec.json.encode({"custom_id": item.custom_id}), item.line == 2, (1, 0, 1, 0)
            )
        assert await b.finalize(batch_id, "completed", 5.0)
        done = await b.get(batch_id, "k")
        assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
        assert len((await files.content(done["output_file_id"], "k")).splitlines()) == 2
        assert len((await files.content(done["error_file_id"], "k")).splitlines()) == 1

    run(closing(scenario()))


def test_cancelled_and_expired_batches_end_with_what_ran(url):
    async def scenario():
        batches, files, _ = await gateway(url, "g")
        cancelled = await started(batches, files, 4)
        (item,) = await batches.claim(cancelled, "k", ENDPOINT, 1)
        assert (await batches.cancel(cancelled, "k"))["status"] == "cancelling"
        assert await batches.cancel(cancelled, "someone else") is None
        assert await batches.stop_waiting(cancelled, 3) == 3 and await batches.unfinished(cancelled) == 1
        assert await batches.finish(item, b'{"custom_id": "r0"}', False, (0, 0, 0, 0))
        assert await batches.finalize(cancelled, "cancelled", 5.0)
        done = await batches.get(cancelled, "k")
        assert done["status"] == "cancelled" and done["cancelled_at"] and done["request_counts"]["completed"] == 1
        expired = await started(batches, files, 2)
        assert await batches.stop_waiting(expired, EXPIRED) == 2 and await batches.finalize(expired, "expired", 5.0)
        done = await batches.get(expired, "k")
        assert done["status"] == "expired" and done["output_file_id"] is None
        lines = [msgspec.json.decode(x) for x in (await files.content(done["error_file_id"], "k")).splitlines()]
        assert [x["error"]["code"] for x in lines] == ["batch_expired"] * 2 and lines[1]["custom_id"] == "r1"

    run(closing(scenario()))


def test_a_bad_input_file_fails_the_batch_with_each_problem_and_its_line():
    good = {"custom_id": "a", "method": "POST", "url": ENDPOINT, "body": {"model": "m"}}
    content = b"\n".join(
        [
            msgspec.json.encode(good),
            b"{not json",
            msgspec.json.encode({**good, "custom_id": "c", "url": "/v1/embeddings"}),
            msgspec.json.encode(good),
            msgspec.json.encode({**good, "custom_id": "b", "body": {"stream": True}}),
        ]
    )
    lines, errors, _ = parse_input(content, ENDPOINT)
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json_line"),
        (3, "mismatched_endpoint"),
        (4, "duplicate_custom_id"),
        (5, "invalid_request"),
    ]
    assert len(lines) == 1
