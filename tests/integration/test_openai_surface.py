"""The rest of the OpenAI surface against the real server: logprobs, echo, best_of, tokenizer routes,
chat_template_kwargs. (Sampling parameters and errors are in test_api.py.)"""

from __future__ import annotations

import math


from tests.conftest import MODEL


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_logprobs_have_tokens_bytes_and_sorted_alternatives(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ask("Name three colours."), max_tokens=20, temperature=0, logprobs=True, top_logprobs=5
    )
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens - (choice.finish_reason == "stop")
    assert b"".join(bytes(t.bytes) for t in content).decode() == choice.message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 5
        alternatives = [t.logprob for t in token.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        # greedy picks a most likely token (bf16 logits can tie, so compare values, not names)
        assert math.isclose(token.top_logprobs[0].logprob, token.logprob) and token.token in [t.token for t in token.top_logprobs]
        assert sum(math.exp(v) for v in alternatives) <= 1.0 + 1e-3


def test_streamed_logprobs_match_the_whole_answer(client):
    kwargs = dict(model=MODEL, messages=ask("Count to five."), max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [t for c in client.chat.completions.create(stream=True, **kwargs) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in whole]
    # bf16: a prompt served from the prefix cache is computed in other shapes, so values differ a little
    assert all(abs(a.logprob - b.logprob) < 0.15 for a, b in zip(streamed, whole))


def test_logprobs_without_alternatives_and_their_limits(client, server):
    reply = client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=4, temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] for t in reply.choices[0].logprobs.content)
    assert client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=4).choices[0].logprobs is None
    for body, param in (({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        response = server.post("/v1/chat/completions", json={"model": MODEL, "messages": ask("Hi"), **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    response = server.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 30})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"


def test_legacy_completion_logprobs_line_up_with_the_text(client):
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=3)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and math.isclose(max(top.values()), value) and math.isclose(top[token], value)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=3, stream=True) if c.choices[0].logprobs]
    assert [t for part in streamed for t in part.tokens] == lp.tokens
    assert [o for part in streamed for o in part.text_offset] == lp.text_offset
