"""Stop strings in streamed text."""

import pytest

from gateway.generate.stop import StopChecker


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    checker = StopChecker(stops)
    sent = []
    for piece in pieces:
        text, stopped = checker.push(piece)
        sent.append(text)
        if stopped:
            return sent, True
    sent.append(checker.flush())
    return sent, False


def test_the_stop_string_is_cut_out_even_across_pieces():
    sent, stopped = run(["END"], ["Hello E", "N", "D and more"])
    assert stopped and "".join(sent) == "Hello "
    assert sent[0] == "Hello "  # the "E" is held back: it could start "END"


def test_a_false_alarm_is_released():
    sent, stopped = run(["END"], ["Hello E", "X", "!"])
    assert not stopped and "".join(sent) == "Hello EX!"
    assert sent[1] == "EX"


def test_the_earliest_of_several_stops_wins():
    sent, stopped = run(["world", "lo"], ["Hello world"])
    assert stopped and "".join(sent) == "Hel"


def test_held_back_text_is_flushed_at_the_end():
    sent, stopped = run(["\n\nUser:"], ["Answer.\n\nUs"])
    assert not stopped and "".join(sent) == "Answer.\n\nUs" and sent[-1] == "\n\nUs"


@pytest.mark.parametrize("stops", [[], [""]])
def test_no_stops_pass_everything_through(stops):
    assert run(stops, ["a", "b"]) == (["a", "b", ""], False)
