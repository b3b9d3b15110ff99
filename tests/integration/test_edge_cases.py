"""OpenAI edge cases a new user hits against ./scripts/serve.sh: a character cut by max_tokens, and
a tiny top_p that must give the greedy text."""

from __future__ import annotations

from tests.conftest import MODEL

EMOJI = "Repeat exactly, and nothing else: 🙂🚀🎉 你好，世界 ☕"


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def unfinished_utf8(tail: bytes) -> bool:
    """Whether ``tail`` is the start of one UTF-8 character and nothing more."""
    try:
        tail.decode()
    except UnicodeDecodeError as exc:
        return exc.reason == "unexpected end of data" and exc.start == 0
    return tail == b""


def _whole_utf8(raw: bytes) -> bool:
    return raw == raw.decode(errors="ignore").encode()


def test_a_character_cut_by_max_tokens_is_dropped_not_sent_as_replacement(client):
    full = client.chat.completions.create(model=MODEL, messages=ask(EMOJI), max_tokens=60, temperature=0, logprobs=True)
    tokens = [bytes(t.bytes) for t in full.choices[0].logprobs.content]
    # The budgets that end inside a character (an emoji or a CJK character spans several tokens);
    # which they are turns on the answer, and a 135M model's answer on the CPU's bf16 arithmetic.
    cutting = [n for n in range(1, len(tokens)) if not _whole_utf8(b"".join(tokens[:n]))]
    assert cutting, f"the answer should spread a character over several tokens: {tokens}"
    cut = None
    for max_tokens in cutting[:3]:  # a second greedy run may flip a near-tie: the first budget that still cuts
        reply = client.chat.completions.create(
            model=MODEL, messages=ask(EMOJI), max_tokens=max_tokens, temperature=0, logprobs=True
        )
        raw = b"".join(bytes(t.bytes) for t in reply.choices[0].logprobs.content)
        if reply.choices[0].finish_reason == "length" and not _whole_utf8(raw):
            cut = (max_tokens, reply, raw)
            break
    assert cut is not None, f"no budget of {cutting[:3]} cut a character"
    max_tokens, reply, raw = cut
    text = reply.choices[0].message.content
    assert "\ufffd" not in text
    assert raw.startswith(text.encode()) and unfinished_utf8(raw[len(text.encode()) :]), (
        "logprobs bytes keep the exact bytes"
    )
    deltas = [
        c.choices[0].delta.content
        for c in client.chat.completions.create(
            model=MODEL, messages=ask(EMOJI), max_tokens=max_tokens, temperature=0, stream=True
        )
        if c.choices and c.choices[0].delta.content
    ]
    assert "".join(deltas) == text and "\ufffd" not in "".join(deltas)


def test_a_completion_cut_inside_an_emoji_ends_cleanly(client):
    for stream in (False, True):
        chunks = client.completions.create(model=MODEL, prompt="🚀" * 10, max_tokens=16, temperature=0, stream=stream)
        text = "".join(c.choices[0].text for c in chunks) if stream else chunks.choices[0].text
        assert text and "\ufffd" not in text, text


def test_a_tiny_top_p_gives_the_greedy_text(client):
    prompt = ask("Tell me something interesting about the ocean.")
    greedy = (
        client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=48, temperature=0)
        .choices[0]
        .message.content
    )
    for _ in range(2):
        nucleus = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=48, temperature=1, top_p=1e-6)
        assert nucleus.choices[0].message.content == greedy
