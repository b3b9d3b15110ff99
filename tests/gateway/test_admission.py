"""Backpressure in the gateway: slots taken all together or not at all, a bounded first-come queue,
and an immediate 429 past both."""

import asyncio
import random
from types import SimpleNamespace

import pytest

from gateway.errors import InvalidRequest, Overloaded, RequestTimeout
from gateway.generate.core import admit
from gateway.policy.admission import Admission


async def queued(admission: Admission, count: int, key: str | None = None) -> None:
    """Until ``count`` requests (of ``key``, if given) wait in the queue (a task started with
    create_task gets there on its first run): the waits below are seen, not assumed from a yield."""
    for _ in range(100):
        if (admission.waiting if key is None else admission.queued(key)) == count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{admission.waiting} requests wait, not {count}")


def test_slots_then_queue_then_refusal():
    async def scenario():
        admission = Admission(max_concurrent=2, max_waiting=1)
        (a,), (b,) = await admission.acquire(), await admission.acquire()
        third = asyncio.create_task(admission.acquire())
        await queued(admission, 1)
        with pytest.raises(Overloaded):
            await admission.acquire()  # refused at once, not after waiting
        a.release()
        (c,) = await asyncio.wait_for(third, 1)
        assert admission.waiting == 0
        for slot in (b, c):
            slot.release()
        b.release()  # releasing twice is harmless
        assert admission.free == 2 and admission.rejected == 1

    asyncio.run(scenario())


def test_a_slot_that_is_dropped_unreleased_is_given_back():
    async def scenario():
        admission = Admission(max_concurrent=1, max_waiting=0)
        slot = await admission.acquire()
        del slot  # e.g. a streaming response that was never iterated
        await asyncio.wait_for(admission.acquire(), 1)

    asyncio.run(scenario())


def test_requests_that_each_need_most_slots_never_deadlock():
    """Two requests of 3 slots each on 4: taken one at a time, each held 2 and waited for the
    third forever. All-or-nothing admits one, then the other."""

    async def scenario():
        admission = Admission(max_concurrent=4, max_waiting=8)
        first = await admission.acquire(3)
        second = asyncio.create_task(admission.acquire(3))
        await queued(admission, 1)
        assert admission.free == 1  # it holds nothing while it waits
        for slot in first:
            slot.release()
        got = await asyncio.wait_for(second, 1)
        assert len(got) == 3 and admission.free == 1

    asyncio.run(scenario())


def test_first_come_first_served_a_big_request_is_not_starved():
    async def scenario():
        admission = Admission(max_concurrent=4, max_waiting=8)
        held = await admission.acquire(2)
        big = asyncio.create_task(admission.acquire(4))
        await queued(admission, 1)
        small = asyncio.create_task(admission.acquire(1))  # 2 slots are free, but the big one came first
        await queued(admission, 2)
        assert admission.free == 2
        for slot in held:
            slot.release()
        granted = await asyncio.wait_for(big, 1)
        assert admission.waiting == 1 and admission.free == 0  # the small one still waits: all 4 went to the big one
        for slot in granted:
            slot.release()
        await asyncio.wait_for(small, 1)

    asyncio.run(scenario())


def test_a_cancelled_wait_takes_nothing_and_lets_the_next_in():
    async def scenario():
        admission = Admission(max_concurrent=2, max_waiting=8)
        held = await admission.acquire(1)
        big = asyncio.create_task(admission.acquire(2))
        await queued(admission, 1)
        small = asyncio.create_task(admission.acquire(1))
        await queued(admission, 2)  # behind the big one, though a slot is free
        big.cancel()  # its client left
        await asyncio.wait_for(small, 1)  # the head changed: the small one fits now
        assert admission.waiting == 0 and admission.free == 0
        held[0].release()
        assert admission.free == 1

    asyncio.run(scenario())


def test_a_request_that_can_never_fit_is_a_400():
    admission = Admission(max_concurrent=256, max_waiting=8)
    admission.check_fits(256, "n", "`n` 16")
    with pytest.raises(InvalidRequest) as refused:
        admission.check_fits(272, "n", "17 prompts × `n` 16")
    assert refused.value.param == "n" and "272" in refused.value.message and "256" in refused.value.message


def test_stalled_only_while_requests_wait_without_progress():
    async def scenario():
        admission = Admission(max_concurrent=1, max_waiting=8, stall_s=0.05)
        held = await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())
        await queued(admission, 1)
        await asyncio.sleep(0.1)  # twice stall_s: the time without progress is the behaviour here
        assert admission.stalled()  # the wait makes no progress
        held[0].release()
        await asyncio.wait_for(waiter, 1)
        assert not admission.stalled()  # nobody waits

    asyncio.run(scenario())


def test_random_mixes_all_end_and_every_slot_comes_back():
    """Many concurrent requests of 1-6 slots on 8, holding them briefly, with some cancelled while
    they wait: every request ends, and all slots are free again at the end."""

    async def scenario():
        rng = random.Random(7)
        admission = Admission(max_concurrent=8, max_waiting=1000)
        done = 0

        async def client(count: int) -> None:
            nonlocal done
            slots = await admission.acquire(count)
            await asyncio.sleep(rng.random() * 0.002)
            for slot in slots:
                slot.release()
            done += 1

        tasks = [asyncio.create_task(client(rng.randint(1, 6))) for _ in range(300)]
        for task in rng.sample(tasks, 30):
            task.cancel()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
        cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
        assert done + cancelled == 300 and cancelled == 30
        assert admission.free == 8 and admission.waiting == 0

    asyncio.run(scenario())


def test_the_admission_wait_counts_toward_the_request_timeout():
    async def scenario():
        admission = Admission(max_concurrent=1, max_waiting=8)
        served = SimpleNamespace(admission=admission, timeout_s=0.05)
        held = await admission.acquire()
        deadline = asyncio.get_running_loop().time() + 0.05
        with pytest.raises(RequestTimeout):
            await asyncio.wait_for(admit(served, 1, deadline, None), 5)
        assert admission.waiting == 0
        held[0].release()
        assert len(await admit(served, 1, asyncio.get_running_loop().time() + 5, None)) == 1

    asyncio.run(scenario())


def test_a_keys_burst_cannot_push_another_keys_request_out_of_the_queue():
    """Key A floods a full queue; key B's request still gets a place (A's newest waiter is refused
    instead) and is served before A's earlier waiters, since B holds no slot; A's refusals are 429s."""

    async def scenario():
        admission = Admission(max_concurrent=2, max_waiting=4)
        running = await admission.acquire(2, key="a")
        flood = [asyncio.create_task(admission.acquire(1, key="a")) for _ in range(4)]
        await queued(admission, 4)
        with pytest.raises(Overloaded):
            await admission.acquire(1, key="a")  # A's own burst past the queue: refused at once
        b = asyncio.create_task(admission.acquire(1, key="b"))
        await queued(admission, 1, key="b")
        assert admission.waiting == 4 and admission.queued("a") == 3 and admission.pushed_out == 1
        with pytest.raises(Overloaded):
            await flood[3]  # A's newest waiter gave its place to B
        running[0].release()
        (granted,) = await asyncio.wait_for(b, 1)  # B first, though A's three came earlier
        assert granted.key == "b" and admission.held["b"] == 1 and admission.queued("a") == 3
        running[1].release()
        (first_a,) = await asyncio.wait_for(flood[0], 1)  # then A's, in their order
        assert not flood[1].done() and admission.rejected == 2
        for slot in (granted, first_a):
            slot.release()
        for task in flood[1:3]:
            for slot in await asyncio.wait_for(task, 1):
                slot.release()
        assert admission.free == 2 and not admission.held and admission.waiting == 0

    asyncio.run(scenario())


def test_a_key_that_queues_as_much_as_the_newcomers_keeps_its_places():
    """Push-out only takes from a key that queues more than the newcomer's would: two keys sharing
    a full queue evenly refuse a third request of either."""

    async def scenario():
        admission = Admission(max_concurrent=1, max_waiting=2)
        (held,) = await admission.acquire(1, key="a")
        waits = [asyncio.create_task(admission.acquire(1, key=k)) for k in ("a", "b")]
        await queued(admission, 2)
        with pytest.raises(Overloaded):
            await admission.acquire(1, key="b")
        assert admission.pushed_out == 0 and admission.queued("a") == admission.queued("b") == 1
        held.release()
        (a_slot,) = await asyncio.wait_for(waits[0], 1)  # both hold nothing now: the earlier goes first
        assert not waits[1].done()
        a_slot.release()
        (b_slot,) = await asyncio.wait_for(waits[1], 1)
        b_slot.release()


def test_waiters_are_granted_most_urgent_first_then_in_arrival_order():
    async def scenario():
        admission = Admission(max_concurrent=1, max_waiting=8)
        (held,) = await admission.acquire()
        order: list[str] = []

        async def wait(name: str, priority: int) -> None:
            (slot,) = await admission.acquire(1, priority=priority)
            order.append(name)
            slot.release()

        tasks = []
        for i, (name, priority) in enumerate((("batch", 2**31), ("b1", 1), ("a", 0), ("b2", 1))):
            tasks.append(asyncio.create_task(wait(name, priority)))
            await queued(admission, i + 1)
        held.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 1)
        assert order == ["a", "b1", "b2", "batch"]

    asyncio.run(scenario())
