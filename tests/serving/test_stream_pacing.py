"""The pacing policy alone (serving/stream_pacing.py): when a stream's held tokens may go, over plain numbers."""
from __future__ import annotations

import random

from ernie_serve.serving.stream_pacing import PacingPolicy, StreamClock

NOW = 100.0


def test_the_first_response_and_the_final_one_never_wait():
    policy = PacingPolicy(interval_tokens=4, coalesce_seconds=0.05)
    assert policy.due_at(StreamClock(sent=0, pending_tokens=1, pending_since=NOW)) == NOW
    final = StreamClock(sent=3, processed=0, paced=True, pending_tokens=1, pending_since=NOW, last_sent_at=NOW,
                        final=True)
    assert policy.due_at(final) == NOW  # lagging, under the interval, inside the window: still at once
    assert policy.due_at(StreamClock(sent=0)) is None  # nothing held, not ended


def test_coalescing_waits_out_the_window_from_the_previous_response():
    policy = PacingPolicy(coalesce_seconds=0.02)
    clock = StreamClock(sent=1, processed=1, pending_tokens=1, pending_since=NOW + 0.005, last_sent_at=NOW)
    assert policy.due_at(clock) == NOW + 0.02
    clock.pending_since = NOW + 0.03  # tokens that arrive after the window go at once
    assert policy.due_at(clock) == NOW + 0.03


def test_the_interval_holds_until_that_many_tokens():
    policy = PacingPolicy(interval_tokens=3)
    clock = StreamClock(sent=1, processed=1, pending_tokens=2, pending_since=NOW, last_sent_at=NOW)
    assert policy.due_at(clock) is None
    clock.pending_tokens = 3
    assert policy.due_at(clock) == NOW


def test_a_lagging_detokenizer_holds_a_paced_stream_at_most_max_hold():
    policy = PacingPolicy(window=2, max_hold_seconds=0.5)
    clock = StreamClock(sent=2, processed=0, paced=True, pending_tokens=1, pending_since=NOW, last_sent_at=NOW)
    assert policy.lagging(clock) and policy.due_at(clock) == NOW + 0.5
    clock.processed = 1  # a report: one behind is inside the window
    assert not policy.lagging(clock) and policy.due_at(clock) == NOW
    clock.paced, clock.processed = False, 0  # a stream without reports is never held
    assert policy.due_at(clock) == NOW


def test_random_clocks_keep_the_bounds_the_docstring_states():
    """For any clock: a due time is never before the tokens were held; a first or final response is due when held;
    otherwise a held token waits at most max(coalesce, max_hold) (the interval aside), and a non-lagging stream
    never sends inside the coalescing window."""
    rng = random.Random(0)
    for _ in range(5000):
        policy = PacingPolicy(interval_tokens=rng.choice([1, 1, 2, 4]), coalesce_seconds=rng.choice([0, 0.01, 0.05]),
                              window=rng.choice([1, 2, 3]), max_hold_seconds=rng.choice([0.1, 0.5]))
        sent = rng.randint(0, 6)
        last = NOW - rng.random() * 0.1 if sent else float("-inf")
        clock = StreamClock(sent=sent, processed=rng.randint(0, sent), paced=rng.random() < 0.5,
                            pending_tokens=rng.randint(0, 5), pending_since=max(NOW - rng.random() * 0.05, last),
                            last_sent_at=last, final=rng.random() < 0.2)
        due = policy.due_at(clock)
        if clock.final or (sent == 0 and clock.pending_tokens):
            assert due == clock.pending_since, clock
            continue
        if clock.pending_tokens == 0 or (not policy.lagging(clock) and clock.pending_tokens < policy.interval_tokens):
            assert due is None, clock
            continue
        assert due >= clock.pending_since, clock
        assert due - clock.pending_since <= max(policy.coalesce_seconds, policy.max_hold_seconds) + 1e-9, clock
        if not policy.lagging(clock):
            assert due >= clock.last_sent_at + policy.coalesce_seconds - 1e-9, clock
