"""vLLM's token-in/token-out endpoints on the shared server: render, generate (streamed and not),
derender and abort, checked against /tokenize and the chat answer."""

from __future__ import annotations

import json

import httpx

from tests.conftest import MODEL

ASK = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Name three colours."}],
    "temperature": 0,
    "max_tokens": 12,
}


def test_render_equals_tokenize_and_generate_then_derender_equals_chat(server, client):
    response = server.post("/v1/chat/completions/render", json=ASK)
    assert response.status_code == 200, response.text
    rendered = response.json()
    tokenized = server.post("/tokenize", json={"model": MODEL, "messages": ASK["messages"]}).json()
    assert rendered["token_ids"] == tokenized["tokens"]
    assert rendered["sampling_params"]["temperature"] == 0 and rendered["sampling_params"]["max_tokens"] == 12
    assert rendered["prompt"].endswith("assistant\n")

    answer = client.chat.completions.create(**ASK)
    generated = server.post("/inference/v1/generate", json=rendered)
    assert generated.status_code == 200, generated.text
    body = generated.json()
    assert body["request_id"] == rendered["request_id"]
    (choice,) = body["choices"]
    assert choice["finish_reason"] == answer.choices[0].finish_reason
    assert body["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    derender = {"model": MODEL, "generate_response": body, "prompt_tokens": len(rendered["token_ids"])}
    chat = server.post("/v1/chat/completions/derender", json=derender).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == answer.choices[0].message.content
    assert chat["usage"]["prompt_tokens"] == answer.usage.prompt_tokens
    assert chat["usage"]["completion_tokens"] == len(choice["token_ids"])

    # Streamed: the same token ids, one output at a time, then usage.
    streamed = {**rendered, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _events(server, streamed)
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == choice["token_ids"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(choice["token_ids"])

    # A stop string: the token ids end where the chat answer's text ends (the stop text's tokens cut).
    text = answer.choices[0].message.content
    words = text.split(" ")
    stop = " " + words[len(words) // 2]  # a stop string that starts where a token does
    stopped_chat = client.chat.completions.create(**ASK, stop=[stop]).choices[0].message.content
    params = {**rendered["sampling_params"], "stop": [stop]}
    cut = server.post("/inference/v1/generate", json={**rendered, "sampling_params": params}).json()
    assert len(cut["choices"][0]["token_ids"]) < len(choice["token_ids"])
    derender["generate_response"] = cut
    again = server.post("/v1/chat/completions/derender", json=derender).json()
    assert again["choices"][0]["message"]["content"] == stopped_chat, (stop, text)


def test_generate_logprobs_are_named_by_id_and_derender_resolves_them(server, tokenizer):
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    body = {"model": MODEL, "token_ids": ids, "sampling_params": {"max_tokens": 3, "temperature": 0, "logprobs": 2}}
    out = server.post("/inference/v1/generate", json=body).json()
    (choice,) = out["choices"]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
    text = server.post("/v1/completions/derender", json={"model": MODEL, "generate_responses": [out]}).json()
    assert text["choices"][0]["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert text["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in choice["token_ids"]]
    completions = server.post("/v1/completions/render", json={"model": MODEL, "prompt": ["a b", "c"]}).json()
    assert [r["token_ids"] for r in completions] == [tokenizer.encode(p) for p in ("a b", "c")]


def test_generate_salts_its_cached_blocks_with_cache_salt(server):
    def cached(salt: str) -> int:
        body = {"token_ids": list(range(300, 380)), "cache_salt": salt, "sampling_params": {"max_tokens": 1}}
        return server.post("/inference/v1/generate", json=body).json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]

    cached("salt-a")
    assert cached("salt-a") >= 64 and cached("salt-b") == 0


def aborted_mid_stream(base: str, abort_base: str, ids: list[str], headers: dict | None = None) -> tuple[dict, list]:
    """A long generate stream on ``base`` (its id ``ids[0]``), and ``ids`` sent to ``abort_base``'s
    /abort_requests once its first chunk came: the abort's answer, and the finish reasons after it."""
    body = {
        "model": MODEL,
        "request_id": ids[0],
        "token_ids": [1, 2, 3],
        "stream": True,
        "sampling_params": {"max_tokens": 2000, "ignore_eos": True},
    }
    answer, finishes = {}, []
    with httpx.stream("POST", base + "/inference/v1/generate", json=body, headers=headers, timeout=120) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                aborted = httpx.post(abort_base + "/abort_requests", json={"request_ids": ids}, headers=headers)
                answer = aborted.json()
                break
        for line in lines:
            if line.startswith("data: {"):
                finishes += [c["finish_reason"] for c in json.loads(line[6:])["choices"]]
    return answer, finishes


def test_abort_ends_a_streamed_generate(server):
    answer, finishes = aborted_mid_stream(server.base_url, server.base_url, ["abort-me", "not-running"])
    assert answer == {"aborted": ["abort-me"], "passed_on": ["not-running"]}
    assert finishes[-1] == "abort" and len(finishes) < 2000


def test_token_io_errors_name_the_field(server):
    empty = {"request_id": "x", "choices": [{"index": 0, "token_ids": []}]}
    bad = server.post("/v1/chat/completions/derender", json={"model": MODEL, "generate_response": empty})
    assert bad.status_code == 400 and "token_ids" in bad.json()["error"]["param"]
    huge = server.post("/inference/v1/generate", json={"model": MODEL, "token_ids": [10**9]})
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "token_ids"


def _events(server, body: dict) -> list[dict]:
    response = server.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_derender_reads_tool_calls_as_chat_does(server, tokenizer):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    ids = tokenizer.encode(call, add_special_tokens=False)
    generated = {"request_id": "gen-1", "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop"}]}
    asked = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools}
    body = {"model": MODEL, "generate_response": generated, "chat_request": asked}
    (choice,) = server.post("/v1/chat/completions/derender", json=body).json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris"}
    (plain,) = server.post("/v1/chat/completions/derender", json={**body, "chat_request": None}).json()["choices"]
    assert plain["message"]["content"] == call and plain["finish_reason"] == "stop"
    bad = server.post("/v1/chat/completions/derender", json={**body, "chat_request": {"messages": 3}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_request"
