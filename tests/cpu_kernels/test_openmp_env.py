"""The OpenMP runtime a model process computes on really gets the process settings _env makes (module docstring
of ernie_serve/_env.py): checked inside fresh interpreters, in the runtime itself, not in os.environ."""
import os
import subprocess
import sys

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


def test_workers_sleep_at_once_after_a_parallel_region_by_default():
    assert blocktime(None) == 0  # the runtime's own default is 200 (ms of spinning)


def test_a_users_blocktime_is_kept():
    assert blocktime("37") == 37
