"""Continuous batching decisions, on plain Python objects (no model)."""

from tests.worker.factories import make_request, make_scheduler
from worker.request import RequestStatus
from worker.scheduler import ScheduledBatch


def test_new_requests_join_and_decode_one_token_each():
    scheduler = make_scheduler()
    a, b = make_request("a", 5), make_request("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"] and batch.num_new_tokens == [5, 3]
    scheduler.update(batch, {"a": [7], "b": [7]})
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [1, 1]


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    request = make_request("long", 20)
    scheduler.add(request)
    chunks = []
    for _ in range(3):
        batch = scheduler.schedule()
        chunks.append(batch.num_new_tokens[0])
        assert batch.total_tokens <= 8
        sampled = {"long": [9]} if request.num_computed_tokens + batch.num_new_tokens[0] == request.num_tokens else {}
        scheduler.update(batch, sampled)
    assert chunks == [8, 8, 4]
    assert request.num_output_tokens == 1  # sampled only once the whole prompt was computed


def test_decodes_keep_running_while_a_prompt_is_chunked():
    scheduler = make_scheduler(num_blocks=32, max_num_batched_tokens=8)
    decoding = make_request("d", 3)
    scheduler.add(decoding)
    scheduler.update(scheduler.schedule(), {"d": [5]})
    scheduler.add(make_request("p", 30))
    for _ in range(3):
        batch = scheduler.schedule()
        assert batch.requests[0] is decoding and batch.num_new_tokens[0] == 1
        assert batch.total_tokens == 8
        scheduler.update(batch, {"d": [5]})


def test_admission_waits_for_free_blocks():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    scheduler.add(make_request("a", 8))
    scheduler.add(make_request("b", 8))
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_max_num_seqs_caps_the_batch():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2)
    for name in "abc":
        scheduler.add(make_request(name, 2))
    assert len(scheduler.schedule()) == 2


def test_preemption_frees_blocks_and_requeues_first():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_request("a", 8, max_new_tokens=20), make_request("b", 8, max_new_tokens=20)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.update(scheduler.schedule(), {"a": [1], "b": [1]})  # both full: 2 blocks each, 9 tokens each
    batch = scheduler.schedule()  # a needs a 3rd block: b is preempted to make room
    assert batch.requests == [a]
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert scheduler.waiting[0] is b and scheduler.num_preemptions == 1
    assert b.token_ids[-1] == 1  # what it generated is kept, to be recomputed


def test_finished_requests_leave_and_free_their_blocks():
    scheduler = make_scheduler(num_blocks=4)
    request = make_request("a", 4, max_new_tokens=1)
    scheduler.add(request)
    finished = scheduler.update(scheduler.schedule(), {"a": [3]})
    assert finished == [request] and request.status == RequestStatus.FINISHED_LENGTH
    assert not scheduler.has_work() and scheduler.blocks.num_free_blocks == 4


def test_stop_token_finishes():
    scheduler = make_scheduler()
    request = make_request("a", 4)
    scheduler.add(request)
    scheduler.update(scheduler.schedule(), {"a": [0]})
    assert request.status == RequestStatus.FINISHED_STOPPED and request.finish_reason == "stop"


def test_abort_frees_a_running_request():
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add(make_request("a", 8))
    scheduler.schedule()
    found = scheduler.finish({"a", "unknown"}, RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in found] == ["a"] and scheduler.blocks.num_free_blocks == 4


def test_prompt_chunks_are_capped_while_others_decode_but_not_when_idle():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    scheduler.max_prefill_chunk = 8
    first = make_request("first", 40)
    scheduler.add(first)
    assert scheduler.schedule().num_new_tokens == [40]  # nothing decoding: the whole budget
    scheduler.update(ScheduledBatch([first], [40]), {"first": [5]})
    scheduler.add(make_request("second", 40))
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [1, 8]  # first decodes; second's prompt comes 8 tokens a step
