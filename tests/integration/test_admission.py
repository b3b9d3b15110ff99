"""Admission against the real server: requests of many slots (``n``, ``best_of``, prompt lists) at
and beyond the limit, from many clients at once, all end within the timeout, and the gateway serves
normally afterwards. One request once held part of its slots while it waited for the rest, and two
such requests wedged every later request for good."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from tests.conftest import MODEL, start_serve, wait_until
from tests.integration.test_operations import sample

SLOTS = 8
TIMEOUT_S = 20.0  # generous: under load the 48 short requests below take seconds each


@pytest.fixture(scope="module")
def small_server():
    server = start_serve(
        "serve-admission",
        1,
        "--max-concurrent-requests",
        str(SLOTS),
        "--max-waiting-requests",
        "64",
        "--request-timeout",
        str(TIMEOUT_S),
    )
    yield server
    server.stop()


def queued(server) -> float:
    return sample(server.get("/metrics").text, "llmpool_gateway_queued_requests")


def test_a_request_that_can_never_fit_is_a_400_naming_the_parameter(small_server):
    url = small_server.base_url
    prompts = {"model": MODEL, "prompt": [f"p{i}" for i in range(3)], "n": 3, "max_tokens": 1}
    refused = httpx.post(url + "/v1/completions", json=prompts, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n", refused.text
    assert "9" in refused.json()["error"]["message"] and str(SLOTS) in refused.json()["error"]["message"]
    many = httpx.post(
        url + "/v1/completions", json={**prompts, "prompt": [f"p{i}" for i in range(9)], "n": 1}, timeout=30
    )
    assert many.status_code == 400 and many.json()["error"]["param"] == "prompt", many.text
    best = httpx.post(url + "/v1/completions", json={**prompts, "prompt": "p", "n": 1, "best_of": 9}, timeout=30)
    assert best.status_code == 400 and best.json()["error"]["param"] == "best_of", best.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 9, "max_tokens": 1}
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).status_code == 400
    fits = httpx.post(url + "/v1/chat/completions", json={**chat, "n": SLOTS}, timeout=30)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == SLOTS


def test_mixes_at_and_beyond_the_limit_from_many_clients_all_end(small_server):
    url = small_server.base_url
    rng = random.Random(11)
    bodies = []
    for _ in range(48):
        kind = rng.choice(["prompts", "best_of", "chat"])
        if kind == "prompts":
            count = rng.randint(1, 4)
            bodies.append(
                ("/v1/completions", {"prompt": [f"Count {i}:" for i in range(count)], "n": rng.randint(1, 3)})
            )
        elif kind == "best_of":
            bodies.append(("/v1/completions", {"prompt": "Once upon", "n": 1, "best_of": rng.randint(2, 9)}))
        else:
            bodies.append(
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": rng.randint(1, 10)})
            )
    outcomes: list[tuple[int, float]] = []
    lock = threading.Lock()

    def send(path: str, body: dict) -> None:
        started = time.monotonic()
        try:
            status = httpx.post(
                url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=TIMEOUT_S + 30
            ).status_code
        except httpx.TimeoutException:
            status = -1  # hung past the timeout and the margin
        with lock:
            outcomes.append((status, time.monotonic() - started))

    threads = [threading.Thread(target=send, args=item) for item in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S + 60)
    statuses = [status for status, _ in outcomes]
    assert len(outcomes) == len(bodies), "every request ends"
    assert set(statuses) <= {200, 400, 429, 504}, statuses
    assert statuses.count(200) >= 5 and statuses.count(400) >= 1, statuses
    assert max(elapsed for _, elapsed in outcomes) < TIMEOUT_S + 15, outcomes
    wait_until(lambda: queued(small_server) == 0, 10, "an empty admission queue")
    assert small_server.get("/ready").status_code == 200
    after = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": ["a", "b"], "n": SLOTS // 2, "max_tokens": 2},
        timeout=30,
    )
    assert after.status_code == 200 and len(after.json()["choices"]) == SLOTS


def test_the_admission_wait_ends_at_the_timeout_and_when_the_client_leaves(small_server):
    url = small_server.base_url + "/v1/chat/completions"
    hold = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "n": SLOTS,
        "max_tokens": 4000,
    }
    with httpx.stream(
        "POST", url, json={**hold, "ignore_eos": True, "stream": True}, timeout=60
    ) as first:  # every slot
        assert first.status_code == 200
        lines = first.iter_lines()
        next(lines)
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up while it waits
            httpx.post(url, json={**hold, "n": 1, "max_tokens": 2}, timeout=1.0)
        wait_until(lambda: queued(small_server) == 0, 10, "the hung-up client's wait to end")
        started = time.monotonic()
        late = httpx.post(url, json={**hold, "n": 1, "max_tokens": 2}, timeout=TIMEOUT_S + 30)
        # It waits for the held stream, which ends at its own deadline (earlier than this one's: first
        # come, first served), so it ends within --request-timeout, the wait included, either way.
        assert late.status_code in (200, 504), late.text
        assert time.monotonic() - started < TIMEOUT_S + 10  # not counted, the wait would add up to TIMEOUT_S more
    wait_until(lambda: small_server.workers()[0]["running"] == 0, 30, "the held stream's choices to end")
    ok = httpx.post(url, json={**hold, "n": 1, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
