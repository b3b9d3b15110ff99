"""What the benchmark sends: the prompts of each workload, and the defaults that go with it.

- ``chat``: today's 16 short chat prompts, cycled (so the prefix cache helps, as in a chat service).
- ``random``: the shape of ``vllm bench serve``'s default: every request a different prompt of
  ``--input-len`` tokens, so nothing is shared beyond the chat template's first block.
- ``long-context``: one stream, unique prompts of ``--input-len`` tokens: decode speed at a long
  context, and the prefill that precedes it (TTFT).
- ``agent``: an agent's turns: one fixed system prompt of about ``--input-len`` tokens (instructions
  and tool definitions as JSON schemas) before a short user turn that differs every time, one
  stream. The first turn computes the system prompt; the prefix cache (and a KV store) serve it after.

Random prompts are made of words that are each one token with their leading space (`` river``),
so a prompt's length is exact under the model's own tokenizer, chat template included; the seed
makes every run (and every server within a run) get the same prompts.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from bench.prompts import PROMPTS

WORKLOADS = ("chat", "random", "long-context", "agent")
DEFAULT_LEVELS = {
    "chat": (1, 8, 32, 64),
    "random": (1, 8, 32),
    "long-context": (1,),
    "agent": (1,),
    "gateway-overhead": (1, 256),
}
DEFAULT_INPUT_LEN = {"random": 1024, "long-context": 4096, "agent": 4000}
_WORD = re.compile(r"Ġ[a-z]{3,12}")  # byte-level BPE: Ġ is the leading space


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompts (user messages) for each concurrency level, and the warm-up's."""

    name: str
    output_len: int
    input_len: int | None  # prompt tokens, chat template included; None: whatever the prompts are
    levels: dict[int, list[str]]
    warmup: list[str]
    system: str | None = None  # a system message before every prompt (agent)


def requests_per_level(concurrency: int, num_prompts: int | None) -> int:
    """``--num-prompts`` when given, else enough for every client to send two (at least 4)."""
    return num_prompts if num_prompts is not None else max(4, 2 * concurrency)


def one_token_words(tokenizer: Any) -> list[str]:
    """Lower-case words that the tokenizer keeps as one token when preceded by a space."""
    return sorted(token[1:] for token in tokenizer.get_vocab() if _WORD.fullmatch(token))


def prompt_tokens(tokenizer: Any, content: str) -> int:
    """Tokens of ``content`` as one user message, with the chat template and generation prompt."""
    messages = [{"role": "user", "content": content}]
    return len(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def random_prompt(tokenizer: Any, words: list[str], rng: random.Random, input_len: int) -> str:
    """A user message of random words whose chat prompt is exactly ``input_len`` tokens."""
    overhead = prompt_tokens(tokenizer, "")
    chosen = [rng.choice(words) for _ in range(max(1, input_len - overhead))]
    # The first word has no leading space (it may take two tokens): measure once, then each word
    # added or dropped at the end moves the count by exactly one.
    excess = prompt_tokens(tokenizer, " ".join(chosen)) - input_len
    if excess > 0:
        del chosen[-excess:]
    else:
        chosen.extend(rng.choice(words) for _ in range(-excess))
    return " ".join(chosen)


def build(
    name: str,
    levels: list[int],
    num_prompts: int | None,
    output_len: int,
    input_len: int | None,
    tokenizer: Any = None,
    seed: int = 0,
) -> Workload:
    """The workload's prompts: ``tokenizer`` (the model's) is needed for random and long-context."""
    counts = {level: requests_per_level(level, num_prompts) for level in levels}
    if name == "chat":
        return Workload(
            name,
            output_len,
            None,
            {level: [PROMPTS[i % len(PROMPTS)] for i in range(n)] for level, n in counts.items()},
            PROMPTS[:2],
        )
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    length = input_len or DEFAULT_INPUT_LEN[name]
    words, rng = one_token_words(tokenizer), random.Random(seed)
    if name == "agent":
        turns = {level: [user_turn(words, rng) for _ in range(n)] for level, n in counts.items()}
        return Workload(
            name,
            output_len,
            None,
            turns,
            [user_turn(words, rng) for _ in range(2)],
            agent_system_prompt(tokenizer, words, rng, length),
        )
    # Unique prompts across levels too: a level must not hit the cache the level before filled.
    prompts = {level: [random_prompt(tokenizer, words, rng, length) for _ in range(n)] for level, n in counts.items()}
    warmup = [random_prompt(tokenizer, words, rng, min(length, 256)) for _ in range(2)]
    return Workload(name, output_len, length, prompts, warmup)


def user_turn(words: list[str], rng: random.Random) -> str:
    """A short user turn (about 12 words), different each time."""
    return " ".join(rng.choice(words) for _ in range(12)).capitalize() + "?"


def agent_system_prompt(tokenizer: Any, words: list[str], rng: random.Random, length: int) -> str:
    """Instructions and tool definitions (OpenAI function schemas, as agents send them), cut to
    about ``length`` tokens of the model's tokenizer."""
    import json

    lines = [
        "You are an autonomous agent. Think step by step, call tools when they help, and answer briefly.",
        "Tools:",
    ]
    while len(tokenizer.encode("\n".join(lines))) < length:
        params = {
            rng.choice(words): {
                "type": rng.choice(["string", "integer", "boolean"]),
                "description": " ".join(rng.sample(words, 6)),
            }
            for _ in range(4)
        }
        tool = {
            "name": "_".join(rng.sample(words, 2)),
            "description": " ".join(rng.sample(words, 14)),
            "parameters": {"type": "object", "properties": params},
        }
        lines.append(json.dumps({"type": "function", "function": tool}))
    text = "\n".join(lines)
    ids = tokenizer.encode(text)[:length]
    return tokenizer.decode(ids)
