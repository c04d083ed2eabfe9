"""The OpenMP runtime a model process computes on really gets the process settings _env makes (module docstring
of ernie_serve/_env.py): checked inside fresh interpreters, in the runtime itself, not in os.environ."""
import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes
import ernie_serve
import paddle
from ernie_serve import _env
_env.setup_model_process()
path = next(line.split()[-1] for line in open("/proc/self/maps") if "libiomp5" in line)
print(ctypes.CDLL(path).kmp_get_blocktime())
"""


def blocktime(env_blocktime: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "KMP_BLOCKTIME"}
    if env_blocktime is not None:
        env["KMP_BLOCKTIME"] = env_blocktime
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_workers_spin_one_ms_after_a_parallel_region_by_default():
    assert blocktime(None) == 1  # the runtime's own default is 200 (ms of spinning)


def test_a_users_blocktime_is_kept():
    assert blocktime("37") == 37


PARK = """
import os, time
import numpy as np
import ernie_serve
from ernie_serve import _env
_env.setup_model_process(2)
from ernie_serve.cpu_kernels import build
lib = build.library()
x, w, y = np.ones((4, 64), np.float32), np.ones((2, 64, 32), np.float32), np.zeros((4, 64), np.float32)

def a_worker_runnable():
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != os.getpid():  # the main thread, reading this, runs
            try:
                if open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0] == "R":
                    return True
            except OSError:
                continue
    return False

def runnable_share_in_a_sleep(park):
    assert lib.ernie_gemm(x.ctypes.data, 4, 64, w.ctypes.data, 64, None, y.ctypes.data, 32, 0, 0) == 0
    if park:
        build.park_threads()
    seen, end = [], time.monotonic() + 0.1
    while time.monotonic() < end:
        seen.append(a_worker_runnable())
        time.sleep(0.004)
    return sum(seen) / len(seen)

print(runnable_share_in_a_sleep(False), runnable_share_in_a_sleep(True), build.threads())
"""


def test_parked_workers_sleep_at_once_and_spin_again_after_the_next_region():
    """The end of a step parks the workers (reference_backend/shard.py); under a blocktime of 200 ms an unparked
    worker spins through the next 100 ms, a parked one sleeps.

    Told apart by the workers' scheduler state, sampled every few ms: a spinning worker is runnable (R) whether or
    not it has a core, a parked one waits (S). The CPU time they burn is no measure on a loaded host: there a
    spinning worker got 5 ms of a 200 ms sleep (load average 14 on 2 cores)."""
    env = dict(os.environ, KMP_BLOCKTIME="200")
    out = subprocess.run([sys.executable, "-c", PARK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    spun, parked, threads = map(float, out.stdout.strip().splitlines()[-1].split())
    assert threads == 2
    assert spun > 0.5 and parked < 0.1, (spun, parked)


def test_every_step_of_the_reference_backend_ends_with_the_workers_parked(tiny_model_dir, monkeypatch):
    """ModelShard.execute parks the workers after each forward, and after one that raised."""
    from ernie_serve import LLM, SamplingParams
    from ernie_serve.reference_backend import shard

    parked = []
    monkeypatch.setattr(shard, "park_threads", lambda: parked.append(1))
    llm = LLM(str(tiny_model_dir), max_model_len=256, max_num_seqs=4, disable_progress_bar=True)
    try:
        executor = llm.engine.runner.executor
        assert isinstance(executor, shard.ModelShard)
        calls = []
        execute = executor.execute
        monkeypatch.setattr(executor, "execute", lambda step: calls.append(1) or execute(step))
        llm.generate(["hello there"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        assert len(calls) >= 5 and len(parked) == len(calls)

        def fails(step):
            raise RuntimeError("boom")

        monkeypatch.setattr(executor, "_forward", fails)
        with pytest.raises(RuntimeError, match="boom"):
            execute(None)
        assert len(parked) == len(calls) + 1
    finally:
        llm.engine.close()
