"""Splitting a reasoning model's text into thinking and answer, streamed in pieces that cut the
markers anywhere; and the budgets requests ask for."""

import pytest

from common.reasoning import ThinkState
from gateway.errors import InvalidRequest
from gateway.generate.reasoning import EFFORT_BUDGETS, Markers, ReasoningParser, model_markers, thinking_budget

MARKERS = Markers("<think>", "</think>", [7], [8], assume_thinking=False)


def split(pieces: list[str], state: ThinkState) -> tuple[str, str, list[tuple[str, str]]]:
    parser = ReasoningParser(MARKERS, state)
    steps = [parser.push(piece) for piece in pieces]
    steps.append(parser.finish())
    return "".join(t for t, _ in steps), "".join(a for _, a in steps), steps


def every_cut(text: str) -> list[list[str]]:
    """The text in two pieces at every place, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize("pieces", every_cut("<think>\nLet me see.</think>\n\nThe answer."))
def test_markers_split_across_pieces_are_found(pieces):
    thinking, answer, steps = split(pieces, ThinkState.PENDING)
    assert (thinking, answer) == ("Let me see.", "The answer.")
    assert not any("<" in t or "<" in a for t, a in steps)  # no piece of a marker is ever sent


@pytest.mark.parametrize("pieces", every_cut("Let me see.</think>The answer."))
def test_the_missing_start_marker_of_deepseek_r1(pieces):
    """The template opened the thinking (or the model is known to omit the marker)."""
    assert split(pieces, ThinkState.THINKING)[:2] == ("Let me see.", "The answer.")


def test_no_thinking_at_all():
    assert split(["The answer", " is 4."], ThinkState.PENDING)[:2] == ("", "The answer is 4.")
    assert split(["<th", "ese are"], ThinkState.PENDING)[:2] == ("", "<these are")  # a start that was not one
    assert split(["x <think>y"], ThinkState.ANSWER)[:2] == ("", "x <think>y")  # after the thinking, markers are text


def test_thinking_cut_short_keeps_its_tail():
    """max_tokens ended the thinking: all of it is thinking, the held-back "</th" included."""
    assert split(["<think>a", "b</th"], ThinkState.PENDING)[:2] == ("ab</th", "")


def test_budgets():
    assert thinking_budget(None, None, "reasoning_effort", "thinking_token_budget") is None
    assert thinking_budget("low", None, "reasoning_effort", "thinking_token_budget") == EFFORT_BUDGETS["low"]
    assert thinking_budget("high", 12, "reasoning_effort", "thinking_token_budget") == 12  # the explicit budget wins
    with pytest.raises(InvalidRequest, match="`reasoning.effort` must be one of"):
        thinking_budget("huge", None, "reasoning.effort", "thinking_token_budget")
    with pytest.raises(InvalidRequest, match="`thinking.budget_tokens` must be 0 or more"):
        thinking_budget(None, -1, "reasoning_effort", "thinking.budget_tokens")


def test_markers_come_from_the_template_and_the_vocabulary():
    """auto needs the template to name the markers; a marker is one token, several, or a special one
    that decoding then keeps in the text the split reads."""
    from common.config import CACHE_DIR
    from common.model_source import load_tokenizer, resolve_model
    from gateway.generate.tokenizer import IncrementalDetokenizer

    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"), CACHE_DIR.env_default())
    several = model_markers("qwen3", tokenizer, "")  # SmolLM2 has no <think> token: "<", "think", ">"
    assert (
        several.start_ids == tokenizer.encode("<think>", add_special_tokens=False)
        and len(several.start_ids) > 1
        and not several.special_ids
    )
    assert model_markers("auto", tokenizer, "{{ messages }}") is None  # the template names no markers
    tokenizer.add_tokens(["<think>", "</think>"])
    auto = model_markers("auto", tokenizer, "{{ '<think>' }}")
    assert auto is not None and not auto.assume_thinking
    assert [*auto.start_ids, *auto.end_ids] == tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert model_markers("deepseek_r1", tokenizer, "").assume_thinking
    assert model_markers("none", tokenizer, "<think>") is None

    tokenizer.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    special = model_markers("auto", tokenizer, "{{ '[THINK]' }}")
    assert special.start == "[THINK]" and special.special_ids == {*special.start_ids, *special.end_ids}
    ids = tokenizer.encode("[THINK]a[/THINK]b", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"  # what a split without the markers would read
    kept = IncrementalDetokenizer(tokenizer, keep=special.special_ids)
    assert kept.push(ids) + kept.flush() == "[THINK]a[/THINK]b"  # the markers stay, the end of sequence does not
    assert split_with(special, "[THINK]a[/THINK]b") == ("a", "b")


def split_with(markers: Markers, text: str) -> tuple[str, str]:
    parser = ReasoningParser(markers, ThinkState.PENDING)
    (thinking, answer), (more, rest) = parser.push(text), parser.finish()
    return thinking + more, answer + rest


def test_earlier_thinking_reaches_the_template_as_reasoning_content():
    from gateway.http.routes.chat import message_dicts
    from gateway.schemas.chat import ChatMessage

    turns = message_dicts(
        [
            ChatMessage(role="user", content="2+2?"),
            ChatMessage(role="assistant", content="4", reasoning="2 and 2 make 4"),
        ]
    )
    assert turns[1]["reasoning_content"] == "2 and 2 make 4" and "reasoning_content" not in turns[0]


def test_earlier_thinking_blocks_reach_the_template_as_reasoning_content():
    from gateway.http.routes.messages_input import chat_messages
    from gateway.schemas.anthropic import AnthropicMessage, ContentBlock

    history = [
        AnthropicMessage(role="user", content="2+2?"),
        AnthropicMessage(
            role="assistant",
            content=[ContentBlock(type="thinking", thinking="2 and 2 make 4"), ContentBlock(type="text", text="4")],
        ),
        AnthropicMessage(role="user", content="And 3+3?"),
    ]
    turns = chat_messages(None, history)
    assert turns[1] == {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4"}
