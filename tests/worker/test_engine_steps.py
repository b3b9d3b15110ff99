"""The engine with a fake runner (no model): scheduling, outputs, failures and refusals, in milliseconds."""

import pytest

from common.protocol import NewRequest, SamplingParams
from tests.worker.factories import drain, tokens
from tests.worker.fake_runner import FakeRunner
from worker.config import WorkerConfig
from worker.engine import Engine


def make_engine(**settings: object) -> tuple[Engine, FakeRunner]:
    runner = FakeRunner(**{k: settings.pop(k) for k in ("num_blocks", "max_model_len") if k in settings})
    return Engine(runner, WorkerConfig(block_size=4, **settings)), runner


def test_requests_run_to_their_budget_in_one_batch():
    engine, runner = make_engine()
    for i in range(3):
        engine.add_request(NewRequest(f"r{i}", [10 * (i + 1), 10 * (i + 1) + 1], 4, SamplingParams(temperature=0)))
    out = drain(engine)
    assert {rid: tokens(o) for rid, o in out.items()} == {
        "r0": [12, 13, 14, 15],
        "r1": [22, 23, 24, 25],
        "r2": [32, 33, 34, 35],
    }
    assert all(o[-1].finish_reason == "length" for o in out.values())
    assert len(runner.batches[0]) == 3 and runner.added == set()


def test_prompts_are_chunked_by_the_token_budget():
    engine, runner = make_engine(max_num_batched_tokens=3)
    engine.add_request(NewRequest("long", list(range(1, 9)), 2, SamplingParams(temperature=0)))
    out = drain(engine)
    assert [n for (rid, n), *_ in runner.batches][:3] == [3, 3, 2]
    assert tokens(out["long"]) == [9, 10]


def test_a_failing_row_ends_alone_and_the_others_go_on():
    engine, runner = make_engine()
    for i in range(5):
        engine.add_request(NewRequest(f"r{i}", [100 + i], 3, SamplingParams(temperature=0)))
    runner.poison.add("r3")
    out = drain(engine)
    (failed,) = out["r3"]
    assert failed.finish_reason == "error" and "IndexError" in failed.error
    assert {rid: tokens(o) for rid, o in out.items() if rid != "r3"} == {
        f"r{i}": [101 + i, 102 + i, 103 + i] for i in (0, 1, 2, 4)
    }


def test_a_step_that_fails_for_every_row_raises_for_the_worker_to_fail_them_all():
    engine, runner = make_engine()
    engine.add_request(NewRequest("b", [5], 3, SamplingParams(temperature=0)))
    engine.add_request(NewRequest("c", [6], 3, SamplingParams(temperature=0)))
    runner.poison |= {"b", "c"}
    with pytest.raises(IndexError):
        engine.step()
    failed = engine.fail_all("step failed")
    assert [o.finish_reason for o in failed] == [
        "error",
        "error",
    ] and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_request_that_can_never_fit_is_rejected_not_stuck():
    engine, _ = make_engine(num_blocks=8)
    engine.add_request(NewRequest("big", list(range(1, 40)), 10, SamplingParams(temperature=0)))
    (output,) = engine.step().outputs
    assert output.finish_reason == "error" and "KV cache" in output.error
    assert not engine.has_work()


@pytest.mark.parametrize(
    "bad",
    [
        {"prompt_token_ids": [1, 1000]},
        {"prompt_token_ids": [1, -1]},
        {"stop_token_ids": [2**63]},
        {"sampling": SamplingParams(temperature=0, logit_bias={1000: 1.0})},
        {"sampling": SamplingParams(temperature=0, logprobs=10**6)},
    ],
    ids=["prompt", "negative-prompt", "stop-token-ids", "logit-bias", "top-logprobs"],
)
def test_token_ids_outside_the_vocabulary_are_refused_at_admission(bad):
    engine, runner = make_engine()
    fields = {"prompt_token_ids": [1, 2], "sampling": SamplingParams(temperature=0), **bad}
    engine.add_request(NewRequest(request_id="bad", max_new_tokens=4, **fields))
    engine.add_request(NewRequest("good", [3, 4], 4, SamplingParams(temperature=0)))
    out = drain(engine)
    (refused,) = out["bad"]
    assert refused.finish_reason == "error" and refused.bad_request and "vocabulary" in refused.error
    assert tokens(out["good"]) == [5, 6, 7, 8] and "bad" not in runner.added


def test_abort_frees_the_blocks_at_once():
    engine, _ = make_engine()
    engine.add_request(NewRequest("a", list(range(1, 10)), 50, SamplingParams(temperature=0)))
    engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    (aborted,) = engine.abort(["a"])
    assert aborted.finish_reason == "abort" and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.has_work()


def test_speculation_drafts_are_verified_through_the_runner():
    """A lone greedy request whose output repeats gets drafts; the fake runner samples only one
    token per row, so every draft is rejected and the output stays what plain decoding gives."""
    engine, runner = make_engine(speculate=3)
    engine.add_request(NewRequest("s", [7, 8, 9, 7, 8], 4, SamplingParams(temperature=0)))
    out = drain(engine)
    assert tokens(out["s"]) == [9, 10, 11, 12]
    assert engine.speculator.proposed_tokens > 0 and engine.speculator.accepted_tokens == 0
