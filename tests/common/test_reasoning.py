"""The thinking state machine the worker enforces and the gateway counts with."""

from common.protocol import Reasoning
from common.reasoning import CLOSED_TAIL, ThinkState, ThinkTracker, initial_state

START, END = 7, 8


def test_the_prompt_decides_where_the_thinking_starts():
    assert (
        initial_state([1, 2, START], START, END, False) == ThinkState.THINKING
    )  # the template opened it (DeepSeek-R1)
    assert (
        initial_state([1, START, 3, 4, END, 5, 6], START, END, False) == ThinkState.ANSWER
    )  # closed at the end (enable_thinking false)
    assert initial_state([1, 2, 3], START, END, False) == ThinkState.PENDING  # the model may open it (Qwen3)
    assert initial_state([1, 2, 3], START, END, True) == ThinkState.THINKING  # DeepSeek-R1 omits the start marker
    earlier_turn = [1, START, 2, END, *range(20, 20 + CLOSED_TAIL)]  # an earlier answer's thinking, long before the end
    assert initial_state(earlier_turn, START, END, False) == ThinkState.PENDING


def test_a_budget_forces_the_end_marker_and_counts_markers_as_reasoning():
    tracker = ThinkTracker(Reasoning(START, END, ThinkState.PENDING, budget=2))
    assert tracker.may_open and tracker.forced() is None
    assert tracker.push(START) and tracker.state == ThinkState.THINKING
    for token in (3, 4):
        assert tracker.forced() is None
        assert tracker.push(token)
    assert tracker.forced() == END
    assert tracker.push(END) and tracker.state == ThinkState.ANSWER
    assert tracker.forced() is None and not tracker.push(5)
    assert (tracker.thinking_tokens, tracker.reasoning_tokens) == (2, 4)


def test_only_answer_tokens_reach_a_grammar():
    tracker = ThinkTracker(Reasoning(START, END, ThinkState.PENDING))
    assert tracker.answer_tokens([START, 3, END, 4, 5]) == [4, 5]
    assert ThinkTracker(Reasoning(START, END, ThinkState.PENDING)).answer_tokens([3, START, 4]) == [
        3,
        START,
        4,
    ]  # no thinking opened: all answer
    assert ThinkTracker(Reasoning(START, END, ThinkState.THINKING)).answer_tokens([3, 4]) == []
