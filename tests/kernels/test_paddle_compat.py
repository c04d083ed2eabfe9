"""DESIGN's claim, checked: on a Paddle-only box (no torch) the runtime enables paddle.enable_compat for
triton and the launchers run on Paddle tensors."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, NoTorch())
sys.path[:0] = [sys.argv[1] + "/backend", sys.argv[1] + "/kernels"]
import numpy as np, paddle
from ernie_kernels import rms_norm, reference
x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
w = np.ones(32, np.float32)
y = rms_norm(paddle.to_tensor(x), paddle.to_tensor(w))
np.testing.assert_allclose(y.numpy(), reference.rms_norm(x, w), rtol=1e-5, atol=1e-5)
import paddle.compat.proxy as proxy
assert proxy.TORCH_PROXY_FINDER in sys.meta_path, "compat was not enabled"
print("ok")
"""


def test_launchers_run_on_paddle_tensors_through_enable_compat_without_torch():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
