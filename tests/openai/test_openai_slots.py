"""The shim's concurrency slots (--max-concurrency, --max-waiting-time), model-free: random acquire / release /
cancel sequences checked against the invariants, and the timeout edges."""
from __future__ import annotations

import asyncio
import random

import pytest

from ernie_client.openai.admission import ConcurrencySlots as _Slots
from ernie_client.openai.errors import OpenAIError
from ernie_client.openai.metrics import Metrics


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize("seed", range(20))
def test_random_acquire_release_cancel_keeps_the_invariants(seed):
    """At most `limit` hold a slot, `active` counts exactly the holders, nobody waits while a slot is free, and
    slots go to waiters in arrival order (a cancelled waiter drops out and takes nothing)."""
    async def scenario():
        rng = random.Random(seed)
        limit = rng.randint(1, 4)
        slots = _Slots(limit, Metrics(), max_wait=-1)
        holders: list[int] = []
        waiting: dict[int, asyncio.Task] = {}
        granted: list[int] = []

        async def client(i: int) -> None:
            await slots.acquire()
            granted.append(i)
            holders.append(i)

        for i in range(200):
            op = rng.random()
            if op < 0.5:
                waiting[i] = asyncio.ensure_future(client(i))
            elif op < 0.8 and holders:
                holders.remove(rng.choice(holders))
                slots.release()
            elif waiting:
                j = rng.choice(sorted(waiting))
                waiting[j].cancel()
            await _settle()
            waiting = {j: t for j, t in waiting.items() if not t.done()}
            assert slots.active == len(holders) <= limit
            assert not waiting or slots.active == limit  # nobody waits beside a free slot
            assert len(slots._queue) == len(waiting)
        assert granted == sorted(granted)  # first come, first served
        for t in waiting.values():
            t.cancel()
        await _settle()
        for _ in list(holders):
            slots.release()
        assert slots.active == 0 and not slots._queue

    asyncio.run(scenario())


def test_without_max_wait_the_request_over_the_limit_is_429_at_once():
    async def scenario():
        metrics = Metrics()
        slots = _Slots(1, metrics)
        await slots.acquire()
        with pytest.raises(OpenAIError) as e:
            await slots.acquire()
        assert e.value.status == 429 and slots.active == 1
        slots.release()
        await slots.acquire()  # the slot came back
    asyncio.run(scenario())


def test_a_waiter_past_max_wait_is_408_and_leaves_the_queue():
    async def scenario():
        metrics = Metrics()
        slots = _Slots(1, metrics, max_wait=0.05)
        await slots.acquire()
        with pytest.raises(OpenAIError) as e:
            await slots.acquire()
        assert e.value.status == 408 and not slots._queue and slots.active == 1
        assert metrics.waiting._value.get() == 0
        slots.release()
        assert slots.active == 0
    asyncio.run(scenario())


def test_a_slot_handed_over_as_the_wait_times_out_is_kept_or_passed_on():
    async def scenario():
        slots = _Slots(1, Metrics(), max_wait=-1)
        await slots.acquire()
        waiter = asyncio.ensure_future(slots.acquire())
        await _settle()
        slots.release()  # handed to the waiter ...
        waiter.cancel()  # ... which is cancelled before it runs: the slot must not be lost
        await _settle()
        assert waiter.cancelled() and slots.active == 0 and not slots._queue
    asyncio.run(scenario())
