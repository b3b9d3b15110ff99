"""A reasoning model through the real gateway and worker, with the real SDKs: its thinking comes
out apart from its answer in every dialect, streamed and not; a budget ends the thinking; a JSON
format holds for the answer after it; ``enable_thinking`` reaches the template.

The model is a tiny random Qwen2 (hidden 64, 2 layers, seeded) with the default model's tokenizer
and a DeepSeek-R1-like template that opens the thinking in the prompt (so the random model thinks
until its budget ends it) unless ``enable_thinking`` is false. Its markers are ``<think>`` and
``</think>`` added as single tokens, or ``<thinking>`` and ``</thinking>``, which the vocabulary
holds only as three tokens each (``<``, ``thinking``, ``>``): the worker matches and forces those
token by token, the gateway splits their text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import jsonschema
import openai
import pytest

from tests.conftest import Server, start_serve
from tests.integration.test_fleet import build_tiny_qwen

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)
NAME = "tiny-thinker"
BUDGET = 4  # thinking tokens: the usage adds the end marker
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Is 7 prime?"}]


@dataclass
class Thinker:
    server: Server
    marker: str  # the start marker's word: "think" or "thinking"
    end_tokens: int  # how many tokens the end marker is (usage counts them as reasoning)


@pytest.fixture(scope="module", params=["think", "thinking"])
def thinker(request, tmp_path_factory) -> Iterator[Thinker]:
    word = request.param
    folder = tmp_path_factory.mktemp("thinker") / NAME
    end_tokens = []

    def with_thinking(tokenizer) -> None:  # a transformers tokenizer
        if word == "think":
            tokenizer.add_tokens(["<think>", "</think>"])  # added, not special: the text keeps them
        tokenizer.chat_template = TEMPLATE.replace("think>", f"{word}>")
        end_tokens.append(len(tokenizer.encode(f"</{word}>", add_special_tokens=False)))

    build_tiny_qwen(folder, with_thinking)
    assert end_tokens == [1 if word == "think" else 3]
    server = start_serve(
        "reasoning",
        1,
        "--model",
        str(folder),
        "--served-model-name",
        NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
    )
    yield Thinker(server, word, end_tokens[0])
    server.stop()


@pytest.fixture(scope="module")
def oai(thinker):  # an openai.OpenAI
    return openai.OpenAI(base_url=thinker.server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(oai, stream: bool = False, **extra):
    body = {"thinking_token_budget": BUDGET, **extra.pop("extra_body", {})}
    args = {"model": NAME, "messages": MESSAGES, "max_tokens": 16, "temperature": 0, **extra}
    return oai.chat.completions.create(stream=stream, extra_body=body, **args)


def test_chat_carries_the_thinking_under_both_names_streamed_or_not(oai, thinker):
    whole = chat(oai)
    message = whole.choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert thinking and message.model_extra["reasoning"] == thinking
    assert message.content and f"{thinker.marker}>" not in thinking + message.content
    reasoning_tokens = BUDGET + thinker.end_tokens  # the thinking, then the end marker the budget forced
    assert (
        whole.usage.completion_tokens == 16
        and whole.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    )

    streamed = {"reasoning_content": "", "reasoning": "", "content": ""}
    for chunk in chat(oai, stream=True):
        for choice in chunk.choices:
            streamed["content"] += choice.delta.content or ""
            for name in ("reasoning_content", "reasoning"):
                streamed[name] += (choice.delta.model_extra or {}).get(name) or ""
    assert streamed == {"reasoning_content": thinking, "reasoning": thinking, "content": message.content}


def test_without_a_budget_the_thinking_runs_to_max_tokens_and_effort_none_skips_it(oai):
    """No budget: the random model never ends its thinking. ``reasoning_effort: none`` makes the
    template close the thinking (enable_thinking false), so all is answer, as with the kwarg itself."""
    unbounded = oai.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    assert (
        unbounded.choices[0].message.content == "" and unbounded.usage.completion_tokens_details.reasoning_tokens == 8
    )
    none = oai.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=8, temperature=0, reasoning_effort="none"
    )
    kwarg = oai.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    for reply in (none, kwarg):
        assert reply.choices[0].message.content and "reasoning_content" not in reply.choices[0].message.model_extra
        assert reply.usage.completion_tokens_details is None
    assert none.choices[0].message.content == kwarg.choices[0].message.content


def test_a_json_format_or_a_forced_call_holds_for_the_answer_after_the_thinking(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    reply = chat(oai, response_format=fmt, max_tokens=64)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), SCHEMA)
    tool = {"type": "function", "function": {"name": "answer", "parameters": SCHEMA}}
    called = (
        chat(oai, tools=[tool], tool_choice={"type": "function", "function": {"name": "answer"}}, max_tokens=64)
        .choices[0]
        .message
    )
    assert called.model_extra["reasoning_content"]  # the tools are in the prompt: another thinking
    jsonschema.validate(json.loads(called.tool_calls[0].function.arguments), SCHEMA)


def test_bad_budgets_are_400s_naming_the_field(oai):
    with pytest.raises(openai.BadRequestError) as error:
        chat(oai, extra_body={"thinking_token_budget": -1})
    assert error.value.body["param"] == "thinking_token_budget"
    with pytest.raises(openai.BadRequestError) as error:
        oai.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, reasoning_effort="enormous")
    assert error.value.body["param"] == "reasoning_effort"


def test_responses_carry_a_reasoning_item_streamed_or_not(oai, thinker):
    thinking = chat(oai).choices[0].message.model_extra["reasoning_content"]
    args = dict(model=NAME, input="Is 7 prime?", max_output_tokens=16, temperature=0, reasoning={"effort": "low"})
    args["extra_body"] = {"thinking_token_budget": BUDGET}  # low is 1024 tokens: the explicit budget wins
    whole = oai.responses.create(**args)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thinking and message.type == "message"
    assert (
        whole.usage.output_tokens_details.reasoning_tokens == BUDGET + thinker.end_tokens
        and whole.reasoning.effort == "low"
    )

    events = list(oai.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    done = events[-1].response
    assert done.output[0].content[0].text == thinking and done.output[1].content[0].text == message.content[0].text
    assert done.usage.output_tokens_details.reasoning_tokens == BUDGET + thinker.end_tokens


def test_messages_carry_thinking_blocks_streamed_or_not(oai, thinker):
    thinking = chat(oai).choices[0].message.model_extra["reasoning_content"]
    claude = anthropic.Anthropic(base_url=thinker.server.base_url, api_key="unused", max_retries=0, timeout=120)
    args = dict(
        model=NAME,
        messages=MESSAGES,
        max_tokens=16,
        thinking={"type": "enabled", "budget_tokens": BUDGET},
        extra_body={"temperature": 0},
    )
    whole = claude.messages.create(**args)
    assert [b.type for b in whole.content] == ["thinking", "text"] and whole.content[0].thinking == thinking

    with claude.messages.stream(**args) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas[0] == "thinking_delta" and "signature_delta" in deltas and "text_delta" in deltas
    assert final.content[0].thinking == thinking and final.content[1].text == whole.content[1].text

    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(**{**args, "thinking": {"type": "enabled"}})  # no budget_tokens
