"""Batches end to end: two gateways on one real PostgreSQL server, one worker serving both (four
sequences at a time; the default dtype, for speed: tests/worker/test_priority.py checks in float32
that preempted batch work gives the same tokens), ``--scheduling-policy priority``. The openai SDK uploads, creates,
polls, lists, cancels and reads the output through either gateway; a batch's requests are shared by
both gateways' runners and survive one of them or the worker being SIGKILLed, each line written
once; and under overload
an urgent request overtakes less urgent ones at the worker."""

from __future__ import annotations

import io
import signal
import threading
import time

import msgspec
import openai
import pytest

from tests.conftest import MODEL, wait_until
from tests.integration.test_state_fleet import ADMIN, KEYS, StateFleet

CHAT = "/v1/chat/completions"


def jsonl(bodies: dict[str, dict], url: str = CHAT) -> io.BytesIO:
    lines = [{"custom_id": cid, "method": "POST", "url": url, "body": body} for cid, body in bodies.items()]
    return io.BytesIO(b"\n".join(msgspec.json.encode(line) for line in lines))


def chat(text: str, max_tokens: int = 8, model: str = MODEL) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}


def lines(sdk: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    parsed = [msgspec.json.decode(x) for x in sdk.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in parsed}
    assert len(by_id) == len(parsed), "each request once"
    return by_id


def finished(sdk: openai.OpenAI, batch_id: str, timeout: float = 240):
    wait_until(
        lambda: sdk.batches.retrieve(batch_id).status in ("completed", "failed", "cancelled"), timeout, "batch end"
    )
    return sdk.batches.retrieve(batch_id)


@pytest.fixture(scope="module")
def fleet(postgres):
    fleet = StateFleet(postgres.database("batch_fleet"))
    fleet.env["LLMPOOL_SCHEDULING_POLICY"] = "priority"
    yield from fleet.run(["--model", MODEL, "--max-num-seqs", "4"], "batch-worker")


def test_the_sdk_runs_a_batch_and_reads_its_output_through_either_gateway(fleet):
    a, b = fleet.sdk(0), fleet.sdk(1)
    bodies = {f"q{i}": chat(f"Count to {i + 2}.") for i in range(5)}
    bodies["missing-model"] = chat("Hi", model="no-such-model")
    upload = a.files.create(file=("input.jsonl", jsonl(bodies)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0 and b.files.retrieve(upload.id).filename == "input.jsonl"
    batch = a.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h", metadata={"run": "1"})
    assert batch.status == "validating" and batch.expires_at == batch.created_at + 86400
    done = finished(b, batch.id)
    assert done.status == "completed" and done.metadata == {"run": "1"} and done.in_progress_at and done.completed_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 5, 1)
    output, errors = lines(b, done.output_file_id), lines(a, done.error_file_id)
    assert sorted(output) == [f"q{i}" for i in range(5)] and list(errors) == ["missing-model"]
    assert errors["missing-model"]["response"]["status_code"] == 404
    answer = output["q1"]["response"]
    assert answer["status_code"] == 200 and answer["request_id"] and answer["body"]["object"] == "chat.completion"
    assert answer["body"]["choices"][0]["message"]["content"] and answer["body"]["model"] == MODEL
    assert done.usage.output_tokens == sum(
        line["response"]["body"]["usage"]["completion_tokens"] for line in output.values()
    )
    usage = fleet.get(1, f"/v1/usage?batch={batch.id}", key=ADMIN).json()["data"]
    assert usage[0]["batch"] == batch.id and usage[0]["output_tokens"] == done.usage.output_tokens
    assert [x.id for x in b.batches.list(limit=1)] == [batch.id] and b.batches.list(limit=1).has_more is False
    other = fleet.sdk(0, KEYS[1])
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)
    assert a.files.delete(upload.id).deleted and upload.id not in [f.id for f in a.files.list()]


def test_bad_batches_get_clear_errors(fleet):
    sdk = fleet.sdk(1)
    with pytest.raises(openai.NotFoundError):
        sdk.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    good = sdk.files.create(file=("in.jsonl", jsonl({"a": chat("Hi")})), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(input_file_id=good.id, endpoint="/v1/images", completion_window="24h")
    assert refused.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError):
        sdk.batches.create(input_file_id=good.id, endpoint=CHAT, completion_window="1h")
    wrong = sdk.files.create(file=("in.jsonl", jsonl({"a": chat("Hi")}, url="/v1/completions")), purpose="batch")
    failed = finished(sdk, sdk.batches.create(input_file_id=wrong.id, endpoint=CHAT, completion_window="24h").id)
    assert failed.status == "failed" and failed.failed_at and failed.errors.data[0].line == 1
    assert failed.errors.data[0].code == "mismatched_endpoint"
    with pytest.raises(openai.BadRequestError):
        sdk.batches.cancel(failed.id)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(**chat("Hi"), extra_body={"priority": 2**40})
    assert refused.value.body["param"] == "priority"


def test_an_urgent_request_overtakes_less_urgent_ones_under_overload(fleet):
    """Six long requests at priority 5 on a worker that runs four at a time; one short request at
    priority -5 arrives once four of them produce tokens: it preempts one and ends before any of them."""
    sdk, ends, lock = fleet.sdk(0), [], threading.Lock()
    streaming: set[int] = set()

    def low(i: int) -> None:
        stream = sdk.chat.completions.create(
            **chat(f"Story {i}", max_tokens=48), stream=True, extra_body={"priority": 5, "ignore_eos": True}
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                with lock:
                    streaming.add(i)
        with lock:
            ends.append(f"low{i}")

    threads = [threading.Thread(target=low, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(streaming) >= 4, 120, "four low-priority streams running", interval=0.02)
    urgent = sdk.chat.completions.create(**chat("Hi", max_tokens=8), extra_body={"priority": -5, "ignore_eos": True})
    with lock:
        ends.append("urgent")
    for thread in threads:
        thread.join(300)
    assert urgent.usage.completion_tokens == 8 and ends[0] == "urgent", ends
    wait_until(  # the count comes with the worker's next heartbeat
        lambda: any(w["preemptions"] > 0 for w in fleet.get(0, "/workers").json()["workers"]), 10, "a preemption"
    )


def test_a_cancelled_batch_keeps_what_ran(fleet):
    sdk = fleet.sdk(0)
    bodies = {f"c{i}": chat(f"Tell a story {i}.", max_tokens=32) for i in range(16)}
    upload = sdk.files.create(file=("c.jsonl", jsonl(bodies)), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    wait_until(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 1, 120, "a request done")
    assert sdk.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = finished(fleet.sdk(1), batch.id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    assert 1 <= done.request_counts.completed < 16
    assert len(lines(sdk, done.output_file_id)) == done.request_counts.completed


def test_a_batch_survives_its_worker_being_killed_and_writes_each_line_once(fleet):
    """The pool's only worker is SIGKILLed while the batch runs and started again after its
    requests gave up waiting for another: they run again, and every line is written once, whole."""
    sdk = fleet.sdk(1)
    bodies = {f"w{i}": chat(f"Count to ten, {i}.", max_tokens=48) | {"ignore_eos": True} for i in range(16)}
    upload = sdk.files.create(file=("w.jsonl", jsonl(bodies)), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")

    def running() -> int:  # the batch's requests at the worker, through either gateway
        return sum(w["inflight"] for i in (0, 1) for w in fleet.get(i, "/workers").json()["workers"])

    wait_until(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 1, 120, "a request done")
    wait_until(lambda: running() > 0, 60, "requests of the batch at the worker", interval=0.05)
    fleet.worker.send_signal(signal.SIGKILL)
    fleet.worker.wait()
    assert sdk.batches.retrieve(batch.id).request_counts.completed < 16, "the batch ended before the kill"
    # Back only after the gateways dropped it (5 missed heartbeats of 1 s) and its requests waited
    # another such period for a worker as orphans: they end with a 503 and go back to waiting (a CI
    # run's slow restart found them written as failed lines, when that was a 500).
    wait_until(lambda: not fleet.ready(0) and not fleet.ready(1), 30, "the dead worker to be dropped")
    time.sleep(6)
    fleet.start_worker("batch-worker-restarted")
    done = finished(sdk, batch.id, timeout=300)
    assert done.status == "completed" and done.request_counts.completed == 16, done.request_counts
    assert done.request_counts.failed == 0
    out = lines(sdk, done.output_file_id)
    assert sorted(out, key=lambda c: int(c[1:])) == list(bodies)
    for line in out.values():
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["usage"]["completion_tokens"] == 48, line
        assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["content"]


def test_two_gateways_share_a_batch_and_it_survives_one_being_killed(fleet):
    # Made through A, which looks at once (B within its next heartbeat): A surely holds claims when
    # it dies. Made through B, B could claim and finish all 16 before A's first look (it did).
    bodies = {f"s{i}": chat(f"Name a colour, {i}.", max_tokens=6) for i in range(16)}
    upload = fleet.sdk(0).files.create(file=("s.jsonl", jsonl(bodies)), purpose="batch")
    batch = fleet.sdk(0).batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    sdk = fleet.sdk(1)

    def runner(i: int) -> dict:
        return fleet.get(i, "/workers").json()["batch_runner"]

    wait_until(lambda: runner(0)["inflight"] > 0, 120, "gateway A running requests of the batch", interval=0.05)
    fleet.gateways[0].send_signal(signal.SIGKILL)  # its claims go back to waiting once its lease runs out
    fleet.gateways[0].wait()
    started = time.monotonic()
    done = finished(sdk, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 16, done.request_counts
    assert sorted(lines(sdk, done.output_file_id), key=lambda c: int(c[1:])) == list(bodies)
    assert time.monotonic() - started < 240
