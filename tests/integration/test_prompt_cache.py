"""Prompt-cache controls on the shared server: ``prompt_cache_key`` and ``x-session-id`` keep a
session's requests on one worker, and Messages reports the tokens a marked request wrote to the
cache (``cache_creation_input_tokens``) apart from those it read."""

from __future__ import annotations

from gateway.generate.core import cache_keys
from gateway.policy.caller import Caller
from gateway.schemas.chat import SamplingOptions
from tests.conftest import MODEL, wait_until


def _assigned(server) -> dict[str, int]:
    return {w["name"]: w["requests_assigned"] for w in server.workers()}


def test_a_prompt_cache_key_or_session_header_keeps_requests_on_one_worker(server):
    server.wait_for_workers(2)  # the launcher restarts a worker that died: both must take requests
    for extra, headers in (({"prompt_cache_key": "tenant-7/session-1"}, {}), ({}, {"x-session-id": "sess-42"})):
        before = _assigned(server)
        for i in range(4):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Question {i}?"}],
                "max_tokens": 1,
                **extra,
            }
            assert server.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        after = _assigned(server)
        assert sorted(after[name] - before.get(name, 0) for name in after) == [0, 4]


def test_cache_salts_follow_the_api_key_unless_shared():
    options = SamplingOptions(prompt_cache_key="k")
    salt_a, key = cache_keys(Caller(owner="key-a"), False, options)
    assert key == "k" and salt_a and salt_a != cache_keys(Caller(owner="key-b"), False, options)[0]
    assert "key-a" not in salt_a  # the owner is hashed, never sent as it is
    assert cache_keys(Caller(owner="key-a"), True, options)[0] is None  # --share-prefix-cache
    assert cache_keys(Caller(session_id="s"), False, SamplingOptions()) == (None, "s")


def test_messages_report_cache_writes_and_reads(server):
    system = [
        {
            "type": "text",
            "text": "You are a terse assistant. " * 12 + "Unique: 5f3a.",
            "cache_control": {"type": "ephemeral"},
        }
    ]
    body = {"model": MODEL, "max_tokens": 1, "system": system, "messages": [{"role": "user", "content": "Hi"}]}
    first = server.post("/v1/messages", json=body).json()["usage"]
    second = server.post("/v1/messages", json=body).json()["usage"]
    total = first["input_tokens"] + first["cache_creation_input_tokens"] + first["cache_read_input_tokens"]
    assert first["cache_creation_input_tokens"] >= 64 and first["cache_read_input_tokens"] == 0
    assert second["cache_read_input_tokens"] >= first["cache_creation_input_tokens"] - 16
    assert second["input_tokens"] + second["cache_creation_input_tokens"] + second["cache_read_input_tokens"] == total
    unmarked = {**body, "system": [{"type": "text", "text": system[0]["text"]}]}
    assert server.post("/v1/messages", json=unmarked).json()["usage"]["cache_creation_input_tokens"] == 0
    # What KV events describe (worker/kv_events.py): each worker's cached blocks, in /workers.
    wait_until(lambda: sum(w["cached_blocks"] for w in server.workers()) >= 4, 10, "cached_blocks in /workers")
