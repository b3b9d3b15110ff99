"""The HTTP API end to end: the launcher, two real workers with the real model, the OpenAI SDK."""

from __future__ import annotations

import json
import subprocess
import threading

import httpx
import openai
import pytest

from tests.conftest import ARTIFACTS, MODEL, wait_until


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_sdk_non_stream(client):
    response = client.chat.completions.create(
        model=MODEL, messages=ask("What is the capital of France?"), max_tokens=24, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 5 and 0 < response.usage.completion_tokens <= 24
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_sdk_stream_follows_openai_chunk_format(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ask("Say hello."), max_tokens=16, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 2, "the answer must arrive token by token"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"]) and chunks[-2].choices[0].finish_reason == finishes[0]
    usage_chunk = chunks[-1]
    # every content chunk carries at least one token (tokens of a split character arrive together)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens >= len(content)
    assert all(c.usage is None for c in chunks[:-1])


def test_curl_stream_framing(server):
    body = json.dumps({"model": MODEL, "messages": ask("Hi"), "stream": True, "max_tokens": 12})
    raw = subprocess.run(
        ["curl", "-sN", server.base_url + "/v1/chat/completions", "-H", "content-type: application/json", "-d", body],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert raw.endswith("data: [DONE]\n\n")
    ids, events = zip(*(e.split("\n", 1) for e in raw.split("\n\n")[:-1]))  # each event: its id, then its data
    stream = ids[0].removeprefix("id: ").rpartition("/")[0]
    assert stream.startswith("chatcmpl-") and list(ids) == [f"id: {stream}/{n}" for n in range(len(ids))]
    assert all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_legacy_completions(client):
    response = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert response.object == "text_completion" and response.choices[0].text.strip()
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
    )
    assert streamed == response.choices[0].text


def test_16_concurrent_streams_complete_and_are_batched(server, client):
    before = {w["name"]: w["batched_steps"] for w in server.workers()}
    results: dict[int, tuple[str, str | None]] = {}

    def one(i: int) -> None:
        text, finish = [], None
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=ask(f"Tell me a fact about the number {i}."),
            max_tokens=32,
            temperature=0.7,
            seed=i,
            stream=True,
        ):
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        results[i] = ("".join(text), finish)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == list(range(16))
    assert all(text and finish in ("stop", "length") for text, finish in results.values())
    after = server.workers()
    batched = sum(w["batched_steps"] - before.get(w["name"], 0) for w in after)
    assert batched > 0, "no worker ran a step with more than one sequence"
    assert max(w["peak_batch_size"] for w in after) > 1


def test_two_workers_both_receive_work(server, client):
    before = {w["name"]: (w["requests_assigned"], w["steps_seen"]) for w in server.workers()}
    # Idle workers tie, and the one holding fewer requests so far gets the next: earlier tests may
    # have left one behind by a few, which the first requests make up.
    gap = max(a for a, _ in before.values()) - min(a for a, _ in before.values())
    for i in range(gap + 4):
        client.chat.completions.create(model=MODEL, messages=ask(f"Count to {i + 2}."), max_tokens=4)
    after = {w["name"]: (w["requests_assigned"], w["steps_seen"]) for w in server.workers()}
    assert len(after) == 2
    for name, (assigned, steps) in after.items():
        assert assigned > before[name][0] and steps > before[name][1], f"{name} got no work"


GREEDY_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three fruits.",
    "Translate 'good morning' into Spanish.",
]


def test_greedy_output_passes_the_closeness_test_against_transformers_generate(client, tokenizer, gguf_reference):
    """Same weights (loaded independently from the GGUF file), bf16 ``generate`` as the reference.

    The server runs its fast paths (the C++ decode kernel with q4 weights by default), so the rule
    is vLLM's closeness test instead of identity: greedy texts agree token for token until they
    diverge, and where they do, each side's token is among the other's top-5 logprobs.
    """
    from bench.accuracy import check_close
    from tests.closeness import reference_reply, served_reply

    reference = gguf_reference
    agreed = []
    for prompt in GREEDY_PROMPTS:
        ids = tokenizer.apply_chat_template(ask(prompt), add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        expected = reference_reply(reference, tokenizer, ask(prompt), 40)
        response = client.chat.completions.create(
            model=MODEL, messages=ask(prompt), max_tokens=40, temperature=0, logprobs=True, top_logprobs=5
        )
        got = served_reply(response)
        close, where = check_close(expected, got)
        assert close, (
            f"{prompt!r}: diverged at token {where} outside each other's top 5: {expected.tokens[where]!r} vs {got.tokens[where]!r}"
        )
        agreed.append(where)
        assert response.usage.prompt_tokens == len(ids)
    # A broken kernel can pass the top-5 rule at one position by luck, not for long stretches.
    assert sum(agreed) / len(agreed) >= 8, f"greedy texts agree for too few tokens: {agreed}"


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"model": "SmolLM2-135M-Instruct", "messages": [', None),
        (json.dumps({"model": MODEL}).encode(), "messages"),
        (json.dumps({"model": MODEL, "messages": []}).encode(), "messages"),
        (json.dumps({"model": MODEL, "messages": ask("x"), "max_tokens": -3}).encode(), "max_tokens"),
        (json.dumps({"model": MODEL, "messages": ask("x"), "temperature": "hot"}).encode(), "temperature"),
        (json.dumps({"model": MODEL, "messages": ask("hello " * 9000)}).encode(), "messages"),
        (json.dumps({"model": MODEL, "messages": ask("x"), "max_tokens": 9000}).encode(), "max_tokens"),
    ],
    ids=[
        "invalid-json",
        "missing-messages",
        "empty-messages",
        "negative-max-tokens",
        "wrong-type",
        "prompt-too-long",
        "prompt-plus-max-tokens-too-long",
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body, param):
    response = server.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    ok = client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=4)
    assert ok.choices[0].message.content


def test_context_errors_name_both_numbers(server):
    response = server.post("/v1/chat/completions", json={"model": MODEL, "messages": ask("x"), "max_tokens": 9000})
    message = response.json()["error"]["message"]
    assert "9000" in message and "8192" in message


def test_unknown_model_and_route_are_404(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=ask("x"))
    assert info.value.body["code"] == "model_not_found"
    response = server.get("/v1/nothing-here")
    assert response.status_code == 404 and "error" in response.json()


def test_client_disconnect_aborts_the_request_on_the_worker(server):
    body = {
        "model": MODEL,
        "messages": ask("Write a very long story."),
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        busy = [w for w in server.workers() if w["inflight"]]
        assert busy, "the request should be in flight"
    # The client is gone: the worker must stop the request and give all of its KV blocks back.
    server.wait_idle(15, "the worker to abort the request and free its blocks")
    steps = {w["name"]: w["steps"] for w in server.workers()}
    seen = {w["name"]: w["heartbeats"] for w in server.workers()}
    wait_until(lambda: all(w["heartbeats"] >= seen[w["name"]] + 2 for w in server.workers()), 10, "two more heartbeats")
    assert {w["name"]: w["steps"] for w in server.workers()} == steps, "a worker kept stepping after the abort"


def test_garbage_non_utf8_and_oversized_bodies_are_refused_and_the_server_keeps_serving(server, client):
    url = "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    garbage = bytes(range(256)) * 4096  # 1 MiB of bytes that are neither JSON nor UTF-8
    assert server.post(url, content=garbage, headers=headers).status_code == 400
    assert server.post(url, content=b'{"model": "\xff\xfe"}', headers=headers).status_code == 400
    too_big = server.post(url, content=b" " * (5 * 2**20), headers=headers)  # over the 4 MiB default
    assert too_big.status_code == 413 and "error" in too_big.json()
    assert client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=4).choices[0].message.content


def test_a_chat_template_in_the_request_is_refused_by_default(server):
    response = server.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": ask("Hi"), "chat_template": "{{ 7 * 7 }}"}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"


def test_cors_is_off_by_default(server):
    response = httpx.options(
        server.base_url + "/v1/models",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"},
    )
    assert "access-control-allow-origin" not in response.headers


def test_the_request_id_comes_back_and_is_logged_on_both_sides(server):
    response = server.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ask("Hi"), "max_tokens": 3},
        headers={"X-Request-Id": "trace-42"},
    )
    rid = response.headers["x-request-id"]
    assert rid.startswith("trace-42-")

    def logged() -> bool:
        log = (ARTIFACTS / "serve-session.log").read_text()
        return f"worker.engine: request {rid} queued" in log and f"gateway.ops.metrics: request {rid} " in log

    wait_until(logged, 10, "the request id in the gateway's and the worker's logs")


def test_a_non_streaming_client_that_hangs_up_gets_its_request_aborted(server):
    body = {"model": MODEL, "messages": ask("Write a very long story."), "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=2)  # gives up, closes the socket
    server.wait_idle(15, "the worker to abort the abandoned request")
    assert server.get("/workers").json()["inflight"] == 0


def test_stop_strings_cut_the_text_in_both_modes_and_end_the_generation(client):
    messages = ask("List three fruits.")
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    words = text.split()
    stop = words[len(words) // 2]  # a word in the middle of the greedy answer
    expected = text[: text.index(stop)]
    cut = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=[stop, "@@@"]
    )
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=messages, stop=[""])


def test_logit_bias_min_tokens_and_penalties_through_the_api(client, tokenizer):
    banana = tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = client.completions.create(
        model=MODEL, prompt="I like", max_tokens=3, temperature=0, logit_bias={str(banana): 100}
    )
    assert forced.choices[0].text == tokenizer.decode([banana] * 3)
    plain = client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=1, temperature=0)
    first = tokenizer.encode(plain.choices[0].message.content, add_special_tokens=False)[0]
    banned = client.chat.completions.create(
        model=MODEL, messages=ask("Hi"), max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].message.content != plain.choices[0].message.content
    short = client.chat.completions.create(
        model=MODEL, messages=ask("Reply with one word: yes or no?"), max_tokens=40, temperature=0
    )
    assert short.usage.completion_tokens < 20 and short.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(
        model=MODEL,
        messages=ask("Reply with one word: yes or no?"),
        max_tokens=40,
        temperature=0,
        extra_body={"min_tokens": 20},
    )
    assert held.usage.completion_tokens >= 20
    penalised = client.chat.completions.create(
        model=MODEL,
        messages=ask("Count: one one one one"),
        max_tokens=20,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.05},
    )
    assert penalised.choices[0].message.content


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"99999999": 1}),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("min_tokens", -1),
    ],
)
def test_out_of_range_sampling_fields_are_400_naming_the_field(server, field, value):
    response = server.post("/v1/chat/completions", json={"model": MODEL, "messages": ask("Hi"), field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_n_choices_in_both_modes(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ask("Name a colour."), max_tokens=8, n=3, seed=5, temperature=1.0
    )
    assert [c.index for c in reply.choices] == [0, 1, 2] and all(c.message.content for c in reply.choices)
    single = client.chat.completions.create(model=MODEL, messages=ask("Name a colour."), max_tokens=8)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens, "the prompt counts once"
    texts: dict[int, str] = {}
    finished = set()
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=ask("Name a colour."),
        max_tokens=8,
        n=3,
        seed=5,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
        last = chunk
    assert finished == {0, 1, 2} and all(texts[i] for i in range(3))
    assert last.usage.prompt_tokens == reply.usage.prompt_tokens and last.usage.completion_tokens >= 3


def test_the_same_seed_gives_the_same_text(client):
    """One request at a time (so batching cannot change the numbers): same seed and params, same text."""

    def sample(seed: int) -> str:
        return (
            client.chat.completions.create(
                model=MODEL, messages=ask("Invent a name for a cat."), max_tokens=12, temperature=1.2, seed=seed
            )
            .choices[0]
            .message.content
        )

    assert sample(11) == sample(11)
    assert len({sample(11), sample(12), sample(13)}) > 1


def test_completions_take_lists_of_prompts_and_token_ids(client, tokenizer):
    ids = tokenizer.encode("The sky is", add_special_tokens=False)
    reply = client.completions.create(model=MODEL, prompt=["The sky is", "Grass is"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    by_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, temperature=0)
    assert len(by_ids.choices) == 2 and by_ids.choices[0].text == by_ids.choices[1].text
    alone = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == alone.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[[1, 2], "mixed", 3], max_tokens=2)


def test_legacy_completion_fields_not_supported_are_refused(server):
    for field, value in (("suffix", "end"),):
        response = server.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, field
