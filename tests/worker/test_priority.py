"""Priority in the worker's scheduler: lower is more urgent, arrival order within one priority; the
least urgent running request is preempted first, and an urgent request that does not fit takes the
place of less urgent ones, which are recomputed later with the same result."""

from common.model_source import resolve_model
from common.protocol import BATCH_PRIORITY, NewRequest, SamplingParams
from tests.worker.factories import make_request, make_scheduler
from tests.worker.test_engine import PROMPTS
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.request import RequestStatus


def urgent(name: str, num_tokens: int, priority: int, max_new_tokens: int = 8):
    request = make_request(name, num_tokens, max_new_tokens)
    request.priority = priority
    return request


def test_waiting_requests_are_admitted_most_urgent_first_then_in_arrival_order():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=3)
    for name, priority in (("late", 5), ("b1", 1), ("a", 0), ("b2", 1), ("neg", -1)):
        scheduler.add(urgent(name, 4, priority))
    assert [r.request_id for r in scheduler.schedule().requests] == ["neg", "a", "b1"]
    assert [r.request_id for r in scheduler.waiting] == ["b2", "late"]


def test_the_least_urgent_running_request_is_preempted_first_even_when_admitted_first():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    batch, interactive = urgent("batch", 8, BATCH_PRIORITY, 20), urgent("chat", 8, 0, 20)
    scheduler.add(batch)
    scheduler.update(scheduler.schedule(), {"batch": [1]})  # the batch request runs alone first
    scheduler.add(interactive)
    scheduler.update(scheduler.schedule(), {"batch": [1], "chat": [1]})  # 4 of 4 blocks taken
    assert scheduler.schedule().requests == [interactive]  # chat needs a 3rd block: batch gives way
    assert batch.status == RequestStatus.PREEMPTED and batch.block_ids == [] and scheduler.waiting[0] is batch


def test_an_urgent_request_that_does_not_fit_takes_the_place_of_batch_work():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2)
    batch = [urgent(f"batch{i}", 4, BATCH_PRIORITY, 20) for i in range(2)]
    for request in batch:
        scheduler.add(request)
    scheduler.update(scheduler.schedule(), {r.request_id: [1] for r in batch})
    chat = urgent("chat", 4, 0)
    scheduler.add(chat)
    step = scheduler.schedule()
    assert step.requests == [chat]  # batch0 keeps its place and its blocks, and sits the step out
    assert batch[0].status == RequestStatus.RUNNING and batch[0].block_ids
    assert batch[1].status == RequestStatus.PREEMPTED and scheduler.waiting[0] is batch[1]
    scheduler.update(step, {r.request_id: [1] for r in step.requests})
    assert scheduler.schedule().requests == [chat] and scheduler.num_preemptions == 1


def test_batch_work_sits_out_the_steps_interactive_work_takes_and_goes_on_after():
    """A step with batch rows beside interactive ones is slower for the interactive ones: batch work
    runs only in the steps that interactive work leaves idle, keeping its blocks meanwhile."""
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=8)
    batch = urgent("batch", 4, BATCH_PRIORITY, 20)
    scheduler.add(batch)
    scheduler.update(scheduler.schedule(), {"batch": [1]})
    chat = urgent("chat", 4, 0, max_new_tokens=2)
    scheduler.add(chat)
    finished: list = []
    while not finished:
        step = scheduler.schedule()
        assert step.requests == [chat] and batch.block_ids
        finished = scheduler.update(step, {"chat": [1]})
    assert finished == [chat] and scheduler.schedule().requests == [batch]


def test_batch_work_preempted_by_interactive_requests_is_recomputed_with_the_same_result():
    """In-process engine, float32 greedy: two batch-priority requests fill the batch (max_num_seqs 2);
    two interactive ones arrive mid-decode and take both places at the next step, until one ends; the
    batch requests then finish with the very tokens they give when nothing interrupts them."""
    source = resolve_model("SmolLM2-135M-Instruct")
    engine = build_engine(source, WorkerConfig(dtype="float32", kv_cache_memory="64MiB", max_num_seqs=2))

    def new(name: str, prompt: list[int], priority: int) -> NewRequest:
        return NewRequest(name, prompt, 16, SamplingParams(temperature=0), priority=priority)

    def run(news: list[NewRequest], arrive_after: int = -1, late: list[NewRequest] = ()) -> tuple[dict, list[set]]:
        for item in news:
            engine.add_request(item)
        out: dict[str, list[int]] = {}
        running: list[set] = []  # who runs after each step, while no request has finished
        steps, done = 0, False
        while engine.has_work():
            if steps == arrive_after:
                for item in late:
                    engine.add_request(item)
            for o in engine.step().outputs:
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
                done = done or o.finish_reason is not None
            if not done:
                running.append({r.request_id for r in engine.scheduler.running})
            steps += 1
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "KV blocks leaked"
        return out, running

    alone, _ = run([new("b0", PROMPTS[0], BATCH_PRIORITY), new("b1", PROMPTS[1], BATCH_PRIORITY)])
    preemptions = engine.scheduler.num_preemptions
    chats = [new("c0", PROMPTS[2], 0), new("c1", PROMPTS[1], 0)]
    mixed, running = run(
        [new("b0", PROMPTS[0], BATCH_PRIORITY), new("b1", PROMPTS[1], BATCH_PRIORITY)], arrive_after=4, late=chats
    )
    assert engine.scheduler.num_preemptions - preemptions == 2, "both batch requests gave way"
    assert running[3] == {"b0", "b1"} and running[4:] and all(ids == {"c0", "c1"} for ids in running[4:]), running
    assert mixed["b0"] == alone["b0"] and mixed["b1"] == alone["b1"]


def test_batch_rows_sitting_a_step_out_do_not_cap_its_prompt_tokens():
    """The prompt-token cap keeps decoding streams' inter-token gaps short; a batch row that sits
    the step out is no such stream, so an interactive prompt beside it gets the step's whole budget."""
    from worker.block_manager import BlockManager
    from worker.scheduler import Scheduler

    scheduler = Scheduler(BlockManager(64, 4), 16, 64, 1024, max_prefill_chunk=8)
    batch = urgent("batch", 4, BATCH_PRIORITY, 20)
    scheduler.add(batch)
    scheduler.update(scheduler.schedule(), {"batch": [1]})  # decoding now
    scheduler.add(urgent("chat", 40, 0))
    step = scheduler.schedule()
    assert [r.request_id for r in step.requests] == ["chat"] and step.num_new_tokens == [40]
