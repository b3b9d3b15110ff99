"""Backpressure in the gateway: slots, a bounded queue, and an immediate 429 past both."""

import asyncio

import pytest

from gateway.admission import Admission
from gateway.errors import Overloaded


def test_slots_then_queue_then_refusal():
    async def scenario():
        admission = Admission(max_concurrent=2, max_waiting=1)
        a, b = await admission.acquire(), await admission.acquire()
        queued = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        assert admission.waiting == 1 and not queued.done()
        with pytest.raises(Overloaded):
            await admission.acquire()  # refused at once, not after waiting
        a.release()
        c = await asyncio.wait_for(queued, 1)
        assert admission.waiting == 0
        for slot in (b, c):
            slot.release()
        b.release()  # releasing twice is harmless
        assert not admission._slots.locked() and admission.rejected == 1

    asyncio.run(scenario())


def test_a_slot_that_is_dropped_unreleased_is_given_back():
    async def scenario():
        admission = Admission(max_concurrent=1, max_waiting=0)
        slot = await admission.acquire()
        del slot  # e.g. a streaming response that was never iterated
        await asyncio.wait_for(admission.acquire(), 1)

    asyncio.run(scenario())
