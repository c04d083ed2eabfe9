"""Tensor-parallel ranks: rank 0 is the engine's own process, ranks 1..N-1 are worker processes it starts.

    driver (engine process)                         worker k (python -m ernie_serve.tensor_parallel.workers)
    scheduler -> ModelRunner -> StepInput
                   StepDeltaEncoder ------pyzmq-----> PersistentBatch -> StepInput
                   shard(rank 0).execute              shard(rank k).execute
                       \\______ collectives (gloo on CPU, NCCL on GPU) ______/
                   logits (all-gathered) -> sampler

Why this shape. vLLM v1 and FastDeploy both keep the scheduler in one process and run the model in
one worker per rank, and vLLM's scheduler sends each worker only what changed while every worker keeps
a persistent batch. So does this engine (tensor_parallel/persistent_batch.py): one pyzmq message per worker per
step carries the step's token ids, the rows to sample, the KV swaps/copies, and per row the request's
key, where its new tokens start, how many there are and the block ids the worker has not seen yet (the
whole table when it was rewritten). Each worker keeps the block tables of the last step's rows and
rebuilds the driver's StepInput from them (positions, slot mapping, padded tables, attention metadata),
so a decode step's message no longer grows with context length: about 56 bytes a sequence plus 8 per
block appended, where the whole StepInput carried every sequence's table padded to the longest (64
decodes at 2k tokens in blocks of 64: 3.7 KB a step instead of 20.1 KB; at 32k the whole step would be
~265 KB). The price is state and CPU. The workers hold block tables, kept in step with the driver by
one rule both sides apply (a request absent from a step is forgotten), and a worker handed a delta it
cannot apply fails loudly. At 64 decodes on this 2-core CPU, encoding on the driver (before it sends)
and rebuilding on each worker (mostly AttentionMetadata.build, which the driver runs too) take several
times what packing and unpacking the whole step does: on one host, where 16 KB cross localhost in
microseconds, that is CPU spent for nothing; it pays off with long contexts, big batches, or ranks on
other hosts.

Besides steps ("step" + the delta), the driver sends "kv-export" (block ids: every rank exports its heads of those
blocks, as its cache stores them, and joins one all-gather, so rank 0 holds the whole blocks a prefill server
exports) and "kv-import" (ids and whole blocks: each rank keeps its heads), on the same socket, so they fall in
order between steps.

Rank 0 runs in the driver's process on the StepInput itself (vLLM and FastDeploy use a separate process
for every rank), so a single-rank engine has no IPC at all and a tensor-parallel one moves no logits
between processes: the lm_head's all-gather delivers them to rank 0, where the sampler runs unchanged.

A shard is either backend's: the reference backend's ModelShard (Paddle on the CPU, model/parallel.py's
collectives) or the kernels backend's KernelShard (triton-lang kernels on one GPU a rank, or in triton's CPU
interpreter; kernels_backend/collectives.py over Paddle or torch). The process group is this engine's own
(process_groups.py: a TCPStore that rank 0 hosts on a port of its own before the workers start, gloo on the CPU,
NCCL on GPUs), never a framework's global one.

Start-up. Each worker reports "hello", then progress while it loads (load_progress.py's ticks: the checkpoint bytes
it has read, about once a second), then "ready". The driver fails start-up only when a worker has been silent for the
start-up timeout, never for taking long: a 300B checkpoint read by eight ranks at once takes as long as the disks do.

Failures. Workers die with the driver (PR_SET_PDEATHSIG). A worker that dies or fails mid-step breaks
the step's collective on rank 0 (gloo raises at once on a closed connection); the executor then names
the rank and how it ended (RankFailedError), stops the other workers and refuses further steps: the
engine fails every request in flight once and reports itself unhealthy (async_engine).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import traceback
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable
from itertools import count
from pathlib import Path

import numpy as np
import zmq

from .. import load_progress
from ..child_process import die_with_parent, python_executable
from .._env import setup_model_process
from ..kv_blocks import KVBlocks
from ..model.parallel import ParallelLayout
from ..process_groups import (STARTUP_TIMEOUT_SECONDS, Rendezvous, host_store, join_store, paddle_group,
                              torch_group)
from .persistent_batch import PersistentBatch, StepDeltaEncoder
from ..step_contract import StepExecutor, StepInput

log = logging.getLogger(__name__)
DEATH_WAIT_SECONDS = 5.0  # after a failed collective: how long to look for the rank that died
PROGRESS_REPORT_SECONDS = 1.0  # a loading worker tells the driver it is alive at most this often
_group_ids = count(1)  # process-group ids are keys in a per-process map: never reuse one


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or failed: the step (and every request in it) cannot complete."""


@dataclass
class ShardSpec:
    """What a rank needs to build its shard (the same for every rank but the rank number)."""
    model_dir: str
    num_output_ids: int | None
    quantization: str | None  # --quantization (online); a pre-quantized checkpoint says its own
    num_blocks: int
    block_size: int
    num_host_blocks: int
    world_size: int
    expert_parallel: bool
    store_port: int
    group_id: int
    mtp_source: str | None = None  # None: no MTP head; "": the checkpoint's own; else speculative_config.model
    weight_bits: int = 32  # the reference backend's float weights: 32, or 16 (bfloat16; reference_backend/support.py)
    # the kernels backend's ranks: the tensor framework and the engine's config (its KV pool is sized per rank,
    # then agreed: num_blocks / num_host_blocks above are the reference backend's)
    backend: str = "reference"
    framework: str = "paddle"
    on_gpu: bool = False
    engine_config: dict | None = None

    @property
    def paddle_on_cpu(self) -> bool:
        return paddle_on_cpu(self.backend, self.framework, self.on_gpu)


def paddle_on_cpu(backend: str, framework: str, on_gpu: bool) -> bool:
    """Whether a rank computes with Paddle on the CPU (its thread count and allocator settings matter)."""
    return backend == "reference" or (framework == "paddle" and not on_gpu)


def _store_framework(backend: str, framework: str) -> str:
    """The framework whose process group (and store) the ranks use: torch only for the kernels backend on torch."""
    return "torch" if backend == "kernels" and framework == "torch" else "paddle"


def threads_per_rank(world_size: int) -> int:
    """The CPU threads one rank's kernels get: the cores shared evenly between the ranks."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


class RankShard:
    """What one rank runs, made in order: the tensor ops on the rank's own device (kernels backend), then the
    process group (every rank joins it before any loads weights), then the shard."""

    def __init__(self, rank: int, spec: ShardSpec):
        self.rank, self.spec = rank, spec
        self.ops = None
        if spec.backend == "kernels":
            from ..kernels_backend.framework import make_tensor_ops

            self.ops = make_tensor_ops(spec.framework, device_index=rank)

    @staticmethod
    def host_store(backend: str, framework: str, world_size: int) -> Rendezvous:
        """Rank 0's TCPStore, listening on a port of its own before any worker is told the port."""
        return host_store(_store_framework(backend, framework), world_size)

    def make_group(self, store=None):
        """This engine's own process group: (group, store). Rank 0 passes the store it hosts; a worker joins it."""
        s = self.spec
        framework = _store_framework(s.backend, s.framework)
        if store is None:
            store = join_store(framework, s.store_port, s.world_size)
        if framework == "torch":
            return torch_group(self.rank, s.world_size, store, s.on_gpu), store
        return paddle_group(self.rank, s.world_size, store, s.group_id, s.on_gpu), store

    def load(self, group) -> StepExecutor:
        s = self.spec
        layout = ParallelLayout(self.rank, s.world_size, s.expert_parallel, group)
        if s.backend == "kernels":
            from ..config import EngineConfig
            from ..kernels_backend.loading import load_kernels_shard
            from ..model.config import ErnieModelConfig

            model_cfg = ErnieModelConfig.from_pretrained(s.model_dir)
            return load_kernels_shard(EngineConfig(**s.engine_config), Path(s.model_dir), model_cfg,
                                      s.num_output_ids or model_cfg.vocab_size, layout, self.ops)
        from ..model.loader import load_model, load_mtp_head
        from ..reference_backend.shard import ModelShard

        model = load_model(s.model_dir, s.num_output_ids, show_progress=False, quantization=s.quantization,
                           layout=layout)
        mtp = None if s.mtp_source is None else load_mtp_head(model, s.model_dir, s.mtp_source or None)
        return ModelShard(model, s.num_blocks, s.block_size, s.num_host_blocks, mtp, s.weight_bits)


class TensorParallelExecutor:
    """The driver's view of all ranks: sends each StepInput to the workers as a delta and runs rank 0 itself."""

    def __init__(self, spec_fields: dict, startup_timeout: float = STARTUP_TIMEOUT_SECONDS):
        """`spec_fields`: ShardSpec's fields but the store port and group id, which are chosen here.
        `startup_timeout`: how long a worker may go without reporting anything (hello, loading progress, ready)
        before start-up fails; there is no limit on the whole start-up, which grows with the checkpoint."""
        rendezvous = RankShard.host_store(spec_fields.get("backend", "reference"),
                                          spec_fields.get("framework", "paddle"), spec_fields["world_size"])
        self.spec = ShardSpec(**spec_fields, store_port=rendezvous.port, group_id=next(_group_ids))
        self.failure: str | None = None
        self._zmq = zmq.Context()
        self._control = self._zmq.socket(zmq.PULL)  # hello / progress / ready / error reports from the workers
        control_port = self._control.bind_to_random_port("tcp://127.0.0.1")
        self._steps, self._procs = [], []
        self._reported: dict[str, set[int]] = {}  # start-up report kind -> the workers that sent it
        self._encoder = StepDeltaEncoder(self.spec.block_size)  # every worker is sent the same deltas
        for rank in range(1, self.spec.world_size):
            sock = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(DEATH_WAIT_SECONDS * 1000))
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            self._steps.append(sock)
            self._procs.append(subprocess.Popen(
                [python_executable(), "-m", "ernie_serve.tensor_parallel.workers", "--rank", str(rank), "--spec",
                 json.dumps(asdict(self.spec)), "--steps", f"tcp://127.0.0.1:{port}",
                 "--control", f"tcp://127.0.0.1:{control_port}", "--driver-pid", str(os.getpid())]))
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._steps + [self._control], self._zmq)
        try:
            self._await("hello", startup_timeout)  # every worker is up and about to join the group
            rank0 = RankShard(0, self.spec)
            self.group, self._store = rank0.make_group(rendezvous.store(still_starting=self._check_alive))
            self.shard = rank0.load(self.group)  # the workers' reports queue meanwhile; _await reads them all first
            self._kv = AllRanksKV(self)
            self.draft_head = None if self.shard.draft_head is None else MirroredDraftHead(self, self.shard.draft_head)
            self._await("ready", startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        log.info("tensor parallel: %d %s ranks (workers %s), %s", self.spec.world_size, self.spec.backend,
                 ", ".join(str(p.pid) for p in self._procs),
                 "expert parallel" if self.spec.expert_parallel else "experts split by intermediate size")

    @property
    def model(self):
        return self.shard.model

    @property
    def cache(self) -> "AllRanksKV":
        """The engine's view of the KV: whole blocks with every KV head, read and written across the ranks."""
        return self._kv

    def export_kv(self, block_ids: list[int]) -> KVBlocks:
        """Every rank's heads of these blocks (the shard's export_kv, a collective the workers join)."""
        ids = json.dumps([int(b) for b in block_ids]).encode()
        return self._on_all_ranks([b"kv-export", ids], lambda: self.shard.export_kv(block_ids))

    def import_kv(self, block_ids: list[int], blocks: KVBlocks) -> None:
        """Each rank stores the heads it holds of these whole blocks."""
        ids = json.dumps([int(b) for b in block_ids]).encode()
        self._on_all_ranks([b"kv-import", ids, *blocks.to_frames()], lambda: self.shard.import_kv(block_ids, blocks))

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def execute(self, step: StepInput):
        return self._on_all_ranks(lambda: [b"step", *self._encoder.encode(step)], lambda: self.shard.execute(step))

    def _on_all_ranks(self, frames, run_on_rank0):
        """Send the workers one message (frames, or a callable making them) and run rank 0's part here."""
        if self.failure is not None:
            raise RankFailedError(self.failure)
        self._check_alive()
        if callable(frames):
            frames = frames()
        try:
            for sock in self._steps:
                sock.send_multipart(frames, copy=False)
            return run_on_rank0()
        except Exception as e:
            # The ranks are out of step now, whatever happened: no further step can run.
            if isinstance(e, zmq.ZMQError) or any(w in str(e).lower() for w in ("gloo", "nccl")):
                self._fail(f"a collective of the step failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            self.failure = f"tensor-parallel rank 0 failed: {type(e).__name__}: {e}"
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the workers; this executor refuses steps from now on."""
        if self.failure is None:
            self.failure = "the engine's tensor-parallel workers were stopped"
        self._finalizer()

    # ------------------------------------------------------------ internals
    def _await(self, kind: str, idle_timeout: float) -> None:
        """Wait until every worker reported `kind`. A worker fails start-up only when nothing (hello, progress,
        ready) came from it for `idle_timeout` seconds of this wait; every queued report is read before any
        worker is judged silent, so one that got ready while rank 0 was loading counts however long that took."""
        heard = dict.fromkeys(range(1, self.spec.world_size), time.monotonic())
        while waiting := set(heard) - self._reported.setdefault(kind, set()):
            self._check_alive()
            self._control.poll(200)
            while self._control.poll(0):
                msg = json.loads(self._control.recv())
                if msg["kind"] == "error":
                    raise RankFailedError(f"tensor-parallel rank {msg['rank']} failed: {msg['error']}")
                heard[msg["rank"]] = time.monotonic()
                self._reported.setdefault(msg["kind"], set()).add(msg["rank"])
            now = time.monotonic()
            silent = sorted(r for r in waiting if now - heard[r] > idle_timeout)
            if silent:
                raise RankFailedError(f"tensor-parallel ranks {silent} reported no progress for {idle_timeout:g} s "
                                      f"while the engine waited for {kind!r} (startup_timeout)")

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) {_how(code)}")

    def _fail(self, what: str) -> None:
        """Name the rank that ended (its own error report, or its exit), stop the rest, refuse further steps."""
        deadline = time.monotonic() + DEATH_WAIT_SECONDS
        culprit = None
        while culprit is None and self._finalizer.alive and time.monotonic() < deadline:
            while self._control.poll(0):
                msg = json.loads(self._control.recv())
                if msg["kind"] == "error":
                    culprit = f"tensor-parallel rank {msg['rank']} failed: {msg['error']}"
            for rank, proc in enumerate(self._procs, start=1):
                code = proc.poll()
                if culprit is None and code is not None:
                    culprit = f"tensor-parallel rank {rank} (pid {proc.pid}) {_how(code)}"
            if culprit is None:
                time.sleep(0.05)
        self.failure = (culprit or what) + "; the engine cannot run further steps and must be restarted"
        log.error("%s", self.failure)
        self.shutdown()
        raise RankFailedError(self.failure)


class AllRanksKV:
    """What the engine reads as `executor.cache` under tensor parallelism: the pool's shape with the model's KV
    heads, and whole-block exports / imports that span the ranks (prefill/decode transfer)."""

    def __init__(self, executor: TensorParallelExecutor):
        local, cfg = executor.shard.cache, executor.shard.model.config
        self._executor = executor
        self.num_blocks, self.num_layers, self.block_size = local.num_blocks, local.num_layers, local.block_size
        self.num_kv_heads, self.head_dim = cfg.num_key_value_heads, local.head_dim
        self.rank0 = local  # rank 0's own PagedKVCache (its share of the heads)

    def export_blocks(self, block_ids: list[int]) -> KVBlocks:
        return self._executor.export_kv(block_ids)

    def import_blocks(self, block_ids: list[int], blocks: KVBlocks) -> None:
        self._executor.import_kv(block_ids, blocks)


class _Hidden:
    """Hidden states of a draft call on rank 0, and the handle the workers keep theirs under."""

    def __init__(self, handle: int, tensor):
        self.handle, self.tensor = handle, tensor


class MirroredDraftHead:
    """The MTP head under tensor parallelism (engine/mtp_drafter.DraftHead): split across the ranks like the target's
    layers, so every rank runs every draft call. Rank 0's calls run here; each is sent to the workers first, on the
    step socket, naming hidden states by handle (0: the step's own, then one per call), so the workers' stay where
    they are. logits is a collective (the vocab-parallel head's all-gather) that returns rank 0's result."""

    def __init__(self, executor: TensorParallelExecutor, head):
        self._executor, self._head = executor, head
        self.block_size = head.block_size
        self._handles = count(1)

    @staticmethod
    def _src(hidden) -> tuple[int, Any]:
        return (hidden.handle, hidden.tensor) if isinstance(hidden, _Hidden) else (0, hidden)

    def take(self, hidden, rows: np.ndarray) -> _Hidden:
        (src, tensor), dst = self._src(hidden), next(self._handles)
        msg = json.dumps({"src": src, "dst": dst, "rows": np.asarray(rows).tolist()}).encode()
        return _Hidden(dst, self._executor._on_all_ranks([b"draft-take", msg], lambda: self._head.take(tensor, rows)))

    def run(self, step: StepInput, hidden) -> _Hidden:
        (src, tensor), dst = self._src(hidden), next(self._handles)
        msg = json.dumps({"src": src, "dst": dst}).encode()
        return _Hidden(dst, self._executor._on_all_ranks([b"draft-run", msg, *step.to_frames()],
                                                        lambda: self._head.run(step, tensor)))

    def logits(self, hidden) -> np.ndarray:
        src, tensor = self._src(hidden)
        msg = json.dumps({"src": src}).encode()
        return self._executor._on_all_ranks([b"draft-logits", msg], lambda: self._head.logits(tensor))


def run_draft_call(head, kind: bytes, frames: list, hidden: dict) -> None:
    """A worker's side of one MirroredDraftHead call: the same call on its own part of the head."""
    msg = json.loads(frames[0].bytes)
    src = hidden[msg["src"]]
    if kind == b"draft-take":
        hidden[msg["dst"]] = head.take(src, np.asarray(msg["rows"], dtype=np.int64))
    elif kind == b"draft-run":
        hidden[msg["dst"]] = head.run(StepInput.from_frames([f.buffer for f in frames[1:]]), src)
    elif kind == b"draft-logits":
        head.logits(src)  # joins the all-gather; rank 0 samples the drafts
    else:
        raise ValueError(f"unknown draft call from the driver: {kind[:32]!r}")


def _how(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _stop(procs: list[subprocess.Popen], sockets: list, ctx: zmq.Context) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    for sock in sockets:
        sock.close(0)
    ctx.term()


# ---------------------------------------------------------------- the worker process
class _ProgressReports:
    """Forwards this worker's start-up ticks to the driver, at most one report every PROGRESS_REPORT_SECONDS."""

    def __init__(self, report: Callable[..., None]):
        self._report, self._last = report, 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last >= PROGRESS_REPORT_SECONDS or done == total:
            self._last = now
            self._report("progress", phase=phase, done=done, total=total)


def worker_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one tensor-parallel rank of an ernie_serve engine (started by it)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--spec", required=True)
    p.add_argument("--steps", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--driver-pid", type=int, required=True)
    args = p.parse_args(argv)
    die_with_parent(args.driver_pid)
    logging.basicConfig(level=logging.INFO, format=f"[rank {args.rank}] %(levelname)s %(message)s")
    spec = ShardSpec(**json.loads(args.spec))
    ctx = zmq.Context()
    control = ctx.socket(zmq.PUSH)
    control.connect(args.control)
    steps = ctx.socket(zmq.PULL)
    steps.connect(args.steps)

    def report(kind: str, **extra) -> None:
        control.send(json.dumps({"kind": kind, "rank": args.rank, **extra}).encode())

    try:
        if spec.paddle_on_cpu:
            setup_model_process(threads_per_rank(spec.world_size))
        me = RankShard(args.rank, spec)
        report("hello")
        group, _store = me.make_group()
        report("progress", phase="joined the process group")
        with load_progress.reporting_to(_ProgressReports(report)):
            shard = me.load(group)
        batch = PersistentBatch(spec.block_size)
        hidden: dict = {}
        report("ready")
        while True:
            if not steps.poll(1000):
                continue  # idle; the driver's death ends this process (PR_SET_PDEATHSIG)
            kind, *frames = steps.recv_multipart(copy=False)
            if kind.bytes == b"step":
                # the step's hidden states: handle 0 of the draft calls that follow it
                hidden = {0: shard.execute(batch.apply([f.buffer for f in frames]))[0]}
            elif kind.bytes.startswith(b"draft-"):
                run_draft_call(shard.draft_head, kind.bytes, frames, hidden)
            elif kind.bytes == b"kv-export":
                shard.export_kv(json.loads(frames[0].bytes))  # joins the all-gather; rank 0 keeps the result
            elif kind.bytes == b"kv-import":
                shard.import_kv(json.loads(frames[0].bytes), KVBlocks.from_frames([f.buffer for f in frames[1:]]))
            else:
                raise ValueError(f"unknown message from the driver: {kind.bytes[:32]!r}")
    except Exception as e:  # noqa: BLE001 - reported to the driver, which fails the engine's requests
        traceback.print_exc()
        report("error", error=f"{type(e).__name__}: {e}")
        time.sleep(0.2)  # let the report leave before the process does
        return 1


if __name__ == "__main__":
    sys.exit(worker_main())
