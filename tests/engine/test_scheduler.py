"""The scheduler without a model: it alone owns queues, token appends, draft rewind, stop rules and freeing.

A step's "model" here is a seeded random token source shaped like ModelRunnerOutput: the scheduler
under test is real, only the logits are not, which is all its contract depends on.
"""
from __future__ import annotations

import random

import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.kv_cache_manager import KVCacheManager
from ernie_serve.engine.request import Request, RequestStatus
from ernie_serve.engine.scheduler import Scheduler
from ernie_serve.engine.step_plan import PLACEHOLDER, ModelRunnerOutput, SchedulerOutput
from ernie_serve.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, **kw) -> Scheduler:
    opts = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, block_size=block_size)
    opts.update(kw)
    config = EngineConfig(**opts)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, config.enable_prefix_caching))


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, **params) -> Request:
    p = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, list(prompt), p, eos_token_ids=[EOS], max_tokens=max_tokens)


def runner_output(so: SchedulerOutput, pick) -> ModelRunnerOutput:
    """Tokens for every scheduled request that samples: pick(request, position index) per position."""
    out = ModelRunnerOutput()
    for s in so.scheduled:
        if s.samples:
            rid = s.request.request_id
            out.sampled[rid] = [pick(s.request, j) for j in range(s.num_spec_tokens + 1)]
            out.logprobs[rid] = [None] * (s.num_spec_tokens + 1)
    return out


def step(sched: Scheduler, pick=lambda r, j: 7):
    so = sched.schedule()
    return so, sched.update_from_output(so, runner_output(so, pick))


def test_update_appends_tokens_and_frees_on_eos():
    sched = make_scheduler()
    req = make_request("a", [5, 6, 7, 8, 9])
    sched.add(req)
    _, updates = step(sched, lambda r, j: 11)
    assert [u.new_token_ids for u in updates] == [[11]]
    assert req.num_computed_tokens == 5 and req.all_token_ids == [5, 6, 7, 8, 9, 11]
    _, updates = step(sched, lambda r, j: EOS)
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason is None
    assert req not in sched.running and req.block_ids == []
    assert sched.kv.num_free_blocks == 64


def test_min_tokens_defers_eos_and_stop_token_ids_finish_with_their_id():
    sched = make_scheduler()
    req = make_request("a", [5, 6], max_tokens=8, min_tokens=2, stop_token_ids=[9])
    sched.add(req)
    step(sched, lambda r, j: EOS)  # below min_tokens: an ordinary token
    assert not req.is_finished
    step(sched, lambda r, j: 9)
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == 9
    assert req.output_token_ids == [EOS, 9]


def test_max_tokens_and_max_model_len_end_with_length():
    sched = make_scheduler(max_model_len=8)
    a, b = make_request("a", [5, 6], max_tokens=3), make_request("b", [5, 6, 7, 8, 9], max_tokens=100)
    b.max_tokens = 100
    sched.add(a)
    sched.add(b)
    for _ in range(5):
        step(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 3
    assert b.status is RequestStatus.FINISHED_LENGTH and b.num_tokens == 8
    assert sched.kv.num_free_blocks == 64


def test_rejected_drafts_are_rewound_and_accepted_ones_kept():
    sched = make_scheduler()
    req = make_request("a", [5, 6, 7], max_tokens=20)
    sched.add(req)
    step(sched, lambda r, j: 10)  # prefill, first token 10
    sched.set_drafts({req: [11, 12, 13]})
    so, updates = step(sched, lambda r, j: [11, 12, 99, 98][j])  # two drafts right, the third wrong
    assert so.scheduled[0].num_tokens == 4 and so.scheduled[0].num_spec_tokens == 3
    assert updates[0].new_token_ids == [11, 12, 99]  # accepted drafts + the target's own token
    assert req.output_token_ids == [10, 11, 12, 99]
    # computed: prompt + 10, 11, 12 (the rejected draft's KV slot is rewound and will be overwritten)
    assert req.num_computed_tokens == req.num_tokens - 1
    assert sched.spec.num_draft_tokens == 3 and sched.spec.num_accepted_tokens == 2


def test_a_stop_in_the_middle_of_accepted_drafts_drops_the_rest():
    sched = make_scheduler()
    req = make_request("a", [5, 6, 7], max_tokens=20)
    sched.add(req)
    step(sched, lambda r, j: 10)
    sched.set_drafts({req: [EOS, 12]})
    step(sched, lambda r, j: [EOS, 12, 13][j])
    assert req.output_token_ids == [10, EOS] and req.status is RequestStatus.FINISHED_STOPPED
    assert sched.kv.num_free_blocks == 64


def test_a_failed_request_ends_alone_with_its_error():
    sched = make_scheduler()
    a, b = make_request("a", [5, 6]), make_request("b", [7, 8])
    sched.add(a)
    sched.add(b)
    so = sched.schedule()
    out = runner_output(so, lambda r, j: 9)
    out.errors["a"] = "no token left"
    updates = sched.update_from_output(so, out)
    assert a.status is RequestStatus.FINISHED_ERROR and a.error == "no token left" and a.block_ids == []
    assert b in sched.running and b.output_token_ids == [9]
    assert {u.request.request_id: u.new_token_ids for u in updates} == {"a": [], "b": [9]}


def test_finish_from_outside_frees_once_and_relabels_a_finished_request():
    sched = make_scheduler()
    req = make_request("a", [5, 6], max_tokens=1)
    sched.add(req)
    step(sched)
    assert req.status is RequestStatus.FINISHED_LENGTH
    free = sched.kv.num_free_blocks
    sched.finish(req, RequestStatus.FINISHED_STOPPED, "stop!")  # a stop string in its last token's text
    assert (req.status, req.stop_reason) == (RequestStatus.FINISHED_STOPPED, "stop!")
    assert sched.kv.num_free_blocks == free


def test_preempted_request_goes_back_to_the_front_and_resumes_with_its_tokens():
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", [10 + i] * 7, max_tokens=30, ignore_eos=True) for i in range(3)]
    for r in reqs:
        sched.add(r)
    preempted = []
    for _ in range(300):
        so, _ = step(sched)
        preempted += so.preempted
        if not sched.running and not sched.waiting:
            break
    assert preempted, "12 blocks of 4 cannot hold three 37-token sequences: someone must be preempted"
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 30 for r in reqs)
    assert sched.kv.num_free_blocks == 12


@pytest.mark.parametrize("seed", range(30))
def test_random_workload_keeps_the_queue_invariants(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    max_len = 64
    sched = make_scheduler(num_blocks=max_len // bs + rng.randint(0, 24), block_size=bs,
                           max_model_len=max_len, max_num_seqs=rng.randint(1, 5),
                           max_num_batched_tokens=rng.choice([8, 16, 64]),
                           long_prefill_token_threshold=rng.choice([0, 4]),
                           enable_prefix_caching=rng.random() < 0.7)
    budget = sched.config.max_num_batched_tokens
    live: dict[str, Request] = {}
    finished: list[Request] = []
    vocab = [3, 4, 5, 6, EOS]
    for i in range(120):
        if rng.random() < 0.3:
            prompt = [rng.choice([3, 4]) for _ in range(rng.randint(1, 30))]
            max_tokens = rng.randint(1, 20)
            req = make_request(f"r{i}", prompt, max_tokens=max_tokens, min_tokens=rng.randint(0, min(2, max_tokens)))
            req.max_tokens = min(req.max_tokens, max_len - len(prompt))
            sched.add(req)
            live[req.request_id] = req
        if rng.random() < 0.05 and live:  # an abort from outside, wherever the request is
            req = live.pop(rng.choice(sorted(live)))
            sched.finish(req, RequestStatus.FINISHED_ABORTED)
            finished.append(req)
        for req in list(sched.running):
            if rng.random() < 0.3 and req.num_computed_tokens == req.num_tokens - 1:
                sched.set_drafts({req: [rng.choice(vocab) for _ in range(rng.randint(1, 3))]})
        so = sched.schedule()
        assert so.num_tokens <= budget
        assert len(sched.running) <= sched.config.max_num_seqs
        for s in so.scheduled:
            assert s.request.status is RequestStatus.RUNNING
            assert len(s.request.block_ids) * bs >= s.request.num_computed_tokens + s.num_tokens
        for req in so.preempted:
            assert req.num_computed_tokens == 0 and req.block_ids == [] and req in sched.waiting
        sched.update_from_output(so, runner_output(so, lambda r, j: rng.choice(vocab)))
        in_running, in_waiting = set(map(id, sched.running)), set(map(id, sched.waiting))
        assert not in_running & in_waiting, "a request is both running and waiting"
        for rid, req in list(live.items()):
            where = (id(req) in in_running) + (id(req) in in_waiting) + req.is_finished
            assert where == 1, f"{rid} must be in exactly one place ({req.status})"
            assert req.num_computed_tokens <= req.num_tokens
            assert req.all_token_ids == req.prompt_token_ids + req.output_token_ids
            if req.is_finished:
                assert req.block_ids == []
                finished.append(live.pop(rid))
        owners = [0] * sched.kv.pool.num_blocks
        for req in sched.running:
            for b in req.block_ids:
                owners[b] += 1
        assert sched.kv.pool.ref_cnt == owners
    for req in list(sched.running) + list(sched.waiting):
        sched.finish(req, RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    for req in finished:
        if req.status is RequestStatus.FINISHED_LENGTH:
            assert req.num_output_tokens == req.max_tokens or req.num_tokens == max_len


def test_all_token_ids_is_one_list_kept_in_place():
    """Read per request per step by the KV manager and the runner: no prompt + output copy per call."""
    req = make_request("a", [1, 2, 3])
    tokens = req.all_token_ids
    req.append_output(9)
    assert req.all_token_ids is tokens and tokens == [1, 2, 3, 9]
    assert req.output_token_ids == [9] and req.num_tokens == 4


def test_a_held_prefill_keeps_its_blocks_until_released_or_failed():
    """A prefill-role request (hold_kv) that completes keeps its blocks in `held` for export; released, or failed
    afterwards (its output processing), they go back to the pool, once."""
    for ending in ("release", "fail"):
        sched = make_scheduler()
        free = sched.kv.num_free_blocks
        req = make_request("p", [5, 6, 7, 8, 9], max_tokens=1)
        req.hold_kv = True
        sched.add(req)
        step(sched)
        assert req.status is RequestStatus.FINISHED_LENGTH and sched.held == {"p": req}
        assert sched.kv.num_free_blocks < free
        if ending == "release":
            sched.release_held(req)
        else:
            sched.fail(req, "output processing failed")
            sched.fail(req, "again")
        assert sched.held == {} and sched.kv.num_free_blocks == free


def test_a_prompt_computing_its_logprobs_is_prefilled_in_bounded_chunks():
    """Each of its prefill tokens costs a vocabulary-wide row of logits: at most PROMPT_LOGPROBS_CHUNK a step, while
    another prompt takes the whole budget; without chunked prefill the prompt still goes in one step."""
    from ernie_serve.engine.scheduler import PROMPT_LOGPROBS_CHUNK

    for chunked in (True, False):
        sched = make_scheduler(num_blocks=1024, max_model_len=4096, max_num_batched_tokens=4096,
                               enable_chunked_prefill=chunked)
        asks = make_request("asks", list(range(3, 1503)), prompt_logprobs=1)
        asks.prompt_logprobs = []
        plain = make_request("plain", list(range(3, 1003)))
        sched.add(asks)
        sched.add(plain)
        so = sched.schedule()
        got = {s.request.request_id: s.num_tokens for s in so.scheduled}
        assert got == ({"asks": PROMPT_LOGPROBS_CHUNK, "plain": 1000} if chunked else {"asks": 1500, "plain": 1000})


# ------------------------------------------------------------------ scheduling ahead (Scheduler.expect)
def _replayed(rid: str, position: int, eos_rate: float) -> int:
    """A token that depends on the request and its position only, like the simulated device's replay: a loop
    that schedules ahead must then give every request the same tokens as the synchronous one."""
    h = random.Random(f"{rid}/{position}")
    return EOS if h.random() < eos_rate else h.randrange(3, 50)


def _plan(so: SchedulerOutput) -> dict[str, int]:
    """Where each sampling row's token goes, read when the step is scheduled (as the runner prepares it)."""
    return {s.request.request_id: s.request.num_computed_tokens + s.num_tokens for s in so.scheduled if s.samples}


def _output(plan: dict[str, int], eos_rate: float) -> ModelRunnerOutput:
    out = ModelRunnerOutput()
    for rid, position in plan.items():
        out.sampled[rid] = [_replayed(rid, position, eos_rate)]
        out.logprobs[rid] = [None]
    return out


def _check_settled(sched: Scheduler, requests: list[Request]) -> None:
    """After a step's update nothing of expect() is left on a request the loop no longer has in flight."""
    for r in requests:
        assert PLACEHOLDER not in r.all_token_ids[:-1], r.request_id
        assert r.all_token_ids[-1] != PLACEHOLDER or r.ahead_computed is not None, r.request_id
        if r.is_finished:
            assert r.block_ids == [] and r not in sched.running and r not in sched.waiting
    pool = sched.kv.pool
    held = {b for r in sched.running for b in r.block_ids}
    assert all(pool.ref_cnt[b] > 0 for b in held)


def _drive(requests: list[Request], ahead: bool, num_blocks: int, aborts: dict[int, str] | None = None,
           eos_rate: float = 0.05, seed: int = 0) -> Scheduler:
    """LLMEngine's loop without a model: synchronous, or scheduling each step ahead of the last one's tokens."""
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=24)
    for r in requests:
        sched.add(r)
    inflight: list[tuple[SchedulerOutput, dict]] = []
    by_id = {r.request_id: r for r in requests}
    for it in range(5000):
        if aborts and it in aborts and not by_id[aborts[it]].is_finished:
            sched.finish(by_id[aborts[it]], RequestStatus.FINISHED_ABORTED)
        if not inflight:
            so = sched.schedule()
            if so.is_empty:
                if not sched.running and not sched.waiting:
                    return sched
                continue
            inflight.append((so, _plan(so)))
        so, plan = inflight.pop(0)
        sched.update_from_output(so, _output(plan, eos_rate))
        _check_settled(sched, [r for r in requests if all(r is not s.request for x, _ in inflight
                                                           for s in x.scheduled)])
        if not ahead:
            continue
        if not inflight:
            following = sched.schedule()
            if not following.is_empty:
                inflight.append((following, _plan(following)))
        if len(inflight) == 1:
            sched.expect(inflight[0][0])
            nxt = sched.schedule()
            if not nxt.is_empty:
                inflight.append((nxt, _plan(nxt)))
    raise AssertionError("the loop did not finish")


def _workload(seed: int) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 50) for _ in range(12)]  # common prefixes: prefix-cache hits
    out = []
    for i in range(rng.randrange(4, 14)):
        prompt = shared[: rng.randrange(0, 12)] + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 30))]
        out.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 40)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_scheduling_ahead_gives_the_synchronous_tokens_and_frees_every_block(seed):
    """Random prompts, lengths, eos positions and pools small enough to preempt: the same tokens and finish
    reasons as the synchronous loop, and every block back at the end."""
    num_blocks = random.Random(seed).choice([14, 20, 64])
    results = {}
    for ahead in (False, True):
        requests = _workload(seed)
        sched = _drive(requests, ahead, num_blocks)
        assert sched.kv.num_free_blocks == num_blocks and all(c == 0 for c in sched.kv.pool.ref_cnt)
        assert all(PLACEHOLDER not in r.all_token_ids for r in requests)
        results[ahead] = {r.request_id: (r.output_token_ids, r.status) for r in requests}
    assert results[True] == results[False]


@pytest.mark.parametrize("seed", range(20))
def test_scheduling_ahead_with_aborts_leaves_no_placeholder_and_no_block(seed):
    rng = random.Random(1000 + seed)
    requests = _workload(1000 + seed)
    aborts = {rng.randrange(0, 60): r.request_id for r in rng.sample(requests, k=len(requests) // 3)}
    sched = _drive(requests, True, rng.choice([14, 64]), aborts)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert all(r.is_finished and PLACEHOLDER not in r.all_token_ids for r in requests)


def test_a_request_preempted_by_the_step_ahead_keeps_the_token_it_sampled():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a, b = make_request("a", [5] * 7, max_tokens=20), make_request("b", [6] * 7, max_tokens=20)
    sched.add(a)
    sched.add(b)
    so = sched.schedule()  # both prefill: 2 blocks each, the pool is full
    sched.update_from_output(so, runner_output(so, lambda r, j: 9))
    running = sched.schedule()  # both decode at position 7, the end of their second block
    assert [s.request.request_id for s in running.scheduled] == ["a", "b"]
    sched.expect(running)
    assert b.all_token_ids[-1] == PLACEHOLDER and b.num_computed_tokens == 8
    ahead = sched.schedule()  # position 8 needs a third block each: b (the last admitted) makes room for a
    assert [s.request.request_id for s in ahead.scheduled] == ["a"] and ahead.preempted == [b]
    # the running step's output, as the runner prepared it before the preemption: a token for both
    sched.update_from_output(running, ModelRunnerOutput(sampled={"a": [11], "b": [11]},
                                                        logprobs={"a": [None], "b": [None]}))
    assert b.status is RequestStatus.PREEMPTED and b.output_token_ids == [9, 11] and b.num_computed_tokens == 0
    assert b.all_token_ids == [6] * 7 + [9, 11] and PLACEHOLDER not in b.all_token_ids and b.ahead_computed is None
    assert a.all_token_ids[-1] == 11 and a.num_computed_tokens == 8


def test_a_request_whose_running_token_is_its_last_is_left_out_of_the_step_ahead():
    sched = make_scheduler()
    a = make_request("a", [5, 6, 7], max_tokens=2)
    sched.add(a)
    so = sched.schedule()
    sched.update_from_output(so, runner_output(so, lambda r, j: 9))
    running = sched.schedule()
    sched.expect(running)  # its second token is its last (max_tokens=2)
    assert a.ends_ahead and sched.schedule().is_empty
    sched.update_from_output(running, runner_output(running, lambda r, j: 10))
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == [9, 10]
