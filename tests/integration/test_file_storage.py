"""``--files-url`` through real gateway processes: two gateways on one state database and one
directory, then one S3 bucket (moto's server, a process), see each other's files through the openai
SDK; a batch made on one from a file uploaded to the other is read from the store by the batch
runner. No worker is needed for files (tests/state/test_file_store.py covers batch outputs)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import free_port, spawn, stop, wait_until
from tests.integration.test_batches import chat, jsonl


@pytest.fixture(scope="module", params=["directory", "s3"])
def pair(request, tmp_path_factory) -> Iterator[tuple[list[openai.OpenAI], str]]:
    """Two gateways sharing a SQLite state file and a file store: their SDK clients, and the place."""
    folder = tmp_path_factory.mktemp("files")
    env = {"LLMPOOL_STATE_URL": f"sqlite:///{folder}/state.db"}
    if request.param == "directory":
        env["LLMPOOL_FILES_URL"] = f"file://{folder}/bytes"
    else:
        s3 = request.getfixturevalue("s3")
        env |= {**s3.env, "LLMPOOL_FILES_URL": f"s3://{s3.bucket}/pair", "LLMPOOL_FILES_S3_ENDPOINT": s3.endpoint}
    ports = [free_port() for _ in range(4)]
    gateways = [
        spawn(
            ["gateway", "--port", str(ports[i]), "--zmq-bind", f"tcp://127.0.0.1:{ports[i + 2]}"],
            f"files-{request.param}-{i}",
            env,
        )
        for i in (0, 1)
    ]
    try:
        for i in (0, 1):
            url = f"http://127.0.0.1:{ports[i]}"
            wait_until(lambda url=url: httpx.get(url + "/health").status_code == 200, 60, f"gateway {i}")
        yield (
            [openai.OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="x", max_retries=0) for p in ports[:2]],
            env["LLMPOOL_FILES_URL"],
        )
    finally:
        for process in gateways:
            stop(process)


def stored(place: str, request) -> set[str]:
    if place.startswith("file://"):
        return set(os.listdir(place[len("file://") :]))
    return {key.rsplit("/", 1)[1] for key in request.getfixturevalue("s3").keys("pair/")}


def test_two_gateways_see_each_others_files_and_batch_inputs(pair, request):
    (a, b), place = pair
    content = jsonl({"x": chat("Hi"), "y": chat("Bye")}).getvalue()
    made = a.files.create(file=("in.jsonl", content), purpose="batch")
    assert made.id in stored(place, request)
    assert b.files.content(made.id).read() == content and b.files.retrieve(made.id).bytes == len(content)
    batch = b.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: a.batches.retrieve(batch.id).status == "in_progress", 30, "the runner to read the input")
    assert a.batches.retrieve(batch.id).request_counts.total == 2
    assert b.files.delete(made.id).deleted and made.id not in stored(place, request)
    with pytest.raises(openai.NotFoundError):
        a.files.content(made.id)
