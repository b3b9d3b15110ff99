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


def _up_to(tokenizer, messages: list[dict], text: str) -> int:
    """How many tokens of the rendered chat prompt come up to the end of ``text`` in it."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(prompt[: prompt.index(text) + len(text)], add_special_tokens=False).input_ids)


def test_messages_report_cache_writes_and_reads(server, tokenizer):
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
    chat = [{"role": "system", "content": system[0]["text"]}, {"role": "user", "content": "Hi"}]
    assert first["cache_creation_input_tokens"] == _up_to(tokenizer, chat, system[0]["text"])  # up to the breakpoint
    assert first["cache_read_input_tokens"] == 0 and 3 <= first["input_tokens"] <= 16  # the user's turn after it
    assert second["cache_read_input_tokens"] >= first["cache_creation_input_tokens"] - 16
    assert second["input_tokens"] + second["cache_creation_input_tokens"] + second["cache_read_input_tokens"] == total
    unmarked = {**body, "system": [{"type": "text", "text": system[0]["text"]}]}
    assert server.post("/v1/messages", json=unmarked).json()["usage"]["cache_creation_input_tokens"] == 0
    # A breakpoint on a message block (ttl 1h: retained), and a ttl Anthropic does not define.
    turn = {"type": "text", "text": "Remember 7c1e. " * 8, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    later = {**body, "messages": [{"role": "user", "content": [turn, {"type": "text", "text": "Now answer."}]}]}
    usage = server.post("/v1/messages", json=later).json()["usage"]
    chat = [{"role": "system", "content": system[0]["text"]}, {"role": "user", "content": turn["text"] + "Now answer."}]
    upto = _up_to(tokenizer, chat, turn["text"])
    assert abs(usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] - upto) <= 1  # a space may join
    turn["cache_control"]["ttl"] = "2h"
    refused = server.post("/v1/messages", json=later)
    assert refused.status_code == 400 and "ttl" in refused.json()["error"]["message"]
    # What KV events describe (worker/kv_events.py): each worker's cached blocks, in /workers.
    wait_until(lambda: sum(w["cached_blocks"] for w in server.workers()) >= 4, 10, "cached_blocks in /workers")
