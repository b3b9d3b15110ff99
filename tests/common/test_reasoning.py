"""The thinking state machine the worker enforces and the gateway counts with, for markers of one
token and of several."""

from common.protocol import Reasoning
from common.reasoning import CLOSED_TAIL, ThinkState, ThinkTracker, initial_state

START, END = [7], [8]
LONG_START, LONG_END = [44, 27, 46], [96, 27, 46]  # "<", "thinking", ">" and "</", "thinking", ">"


def test_the_prompt_decides_where_the_thinking_starts():
    for start, end in ((START, END), (LONG_START, LONG_END)):
        assert initial_state([1, 2, *start], start, end, False) == ThinkState.THINKING  # the template opened it (R1)
        closed = [1, *start, 3, 4, *end, 5, 6]  # closed at the end (enable_thinking false)
        assert initial_state(closed, start, end, False) == ThinkState.ANSWER
        assert initial_state([1, 2, 3], start, end, False) == ThinkState.PENDING  # the model may open it (Qwen3)
        assert initial_state([1, 2, 3], start, end, True) == ThinkState.THINKING  # DeepSeek-R1 omits the start
        earlier_turn = [1, *start, 2, *end, *range(100, 100 + CLOSED_TAIL)]  # an earlier answer's, long before
        assert initial_state(earlier_turn, start, end, False) == ThinkState.PENDING
    # a marker's tokens only in part, or out of order, are no marker
    assert initial_state([1, 44, 27, 2, 46], LONG_START, LONG_END, False) == ThinkState.PENDING


def test_a_budget_forces_the_end_marker_and_counts_markers_as_reasoning():
    tracker = ThinkTracker(Reasoning(START, END, ThinkState.PENDING, budget=2))
    assert tracker.opening() == START[0] and tracker.forced() is None
    tracker.push(START[0])
    assert tracker.state == ThinkState.THINKING and tracker.opening() is None
    for token in (3, 4):
        assert tracker.forced() is None
        tracker.push(token)
    assert tracker.forced() == END[0]
    tracker.push(END[0])
    assert tracker.state == ThinkState.ANSWER and tracker.forced() is None
    tracker.push(5)
    assert (tracker.thinking_tokens, tracker.reasoning_tokens) == (2, 4)


def test_a_marker_of_several_tokens_is_matched_as_they_come_and_forced_whole():
    tracker = ThinkTracker(Reasoning(LONG_START, LONG_END, ThinkState.PENDING, budget=4))
    for token in LONG_START:
        assert tracker.opening() == token and not tracker.answers(token)
        tracker.push(token)
    assert tracker.state == ThinkState.THINKING and tracker.reasoning_tokens == 3
    for token in (96, 27, 5, 96):  # "</thinking" then not ">": no marker; a new "</" begins one
        tracker.push(token)
    assert tracker.state == ThinkState.THINKING and (tracker.thinking_tokens, tracker.matched) == (3, 1)
    assert tracker.forced() is None  # 3 thinking tokens of 4, the "</" may be the marker
    tracker.push(6)  # it was not: 5 thinking tokens, over the budget
    assert tracker.thinking_tokens == 5
    forced = []
    while (token := tracker.forced()) is not None:
        forced.append(token)
        tracker.push(token)
    assert forced == LONG_END and tracker.state == ThinkState.ANSWER
    assert (tracker.thinking_tokens, tracker.reasoning_tokens) == (5, 3 + 5 + 3)

    begun = ThinkTracker(Reasoning(LONG_START, LONG_END, ThinkState.THINKING, budget=1))
    for token in (5, 96, 27):  # the model began the end marker itself past its budget: forcing finishes it
        begun.push(token)
    assert begun.forced() == 46


def test_a_start_that_turns_out_no_marker_is_the_answer():
    tracker = ThinkTracker(Reasoning(LONG_START, LONG_END, ThinkState.PENDING))
    tracker.push(44)
    assert tracker.state == ThinkState.PENDING and tracker.opening() == 27 and tracker.answers(9)
    tracker.push(9)  # "<" then not "thinking": an answer such as "<html>"
    assert tracker.state == ThinkState.ANSWER and tracker.reasoning_tokens == 0 and tracker.opening() is None


def test_only_answer_tokens_reach_a_grammar():
    tracker = ThinkTracker(Reasoning(START, END, ThinkState.PENDING))
    assert tracker.answer_tokens([*START, 3, *END, 4, 5]) == [4, 5]
    no_thinking = ThinkTracker(Reasoning(START, END, ThinkState.PENDING)).answer_tokens([3, *START, 4])
    assert no_thinking == [3, *START, 4]  # no thinking opened: all answer
    assert ThinkTracker(Reasoning(START, END, ThinkState.THINKING)).answer_tokens([3, 4]) == []
    long = ThinkTracker(Reasoning(LONG_START, LONG_END, ThinkState.PENDING))
    assert long.answer_tokens([*LONG_START, 3, 96, 4, *LONG_END, 5, 96]) == [5, 96]
