"""Which device and stream triton's GPU driver launches our kernels on, per tensor framework, checked without a GPU:
the driver binds them from `torch` when it is made, so a subclass of triton's GPUDriver made in a fresh process
reports what a real launch would use."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ernie_kernels._runtime import enable_paddle_compat, needs_paddle_compat

ROOT = Path(__file__).resolve().parents[2]

_DRIVER_BINDINGS = """
import ernie_kernels._runtime
from triton.backends.driver import GPUDriver

class Probe(GPUDriver):  # the abstract parts are never called: only GPUDriver.__init__'s bindings are read
    get_current_target = get_active_torch_device = map_python_to_cpp_type = get_benchmarker = None
    get_device_interface = get_empty_cache_for_benchmark = clear_cache = None
    is_active = classmethod(lambda cls: False)

probe = Probe()
print(probe.get_current_stream.__module__, probe.get_current_device.__module__)
"""


def _driver_modules(framework: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as on a GPU: a driver, not the interpreter
    env.update(ERNIE_TENSOR_FRAMEWORK=framework, PYTHONPATH=os.pathsep.join([str(ROOT / "kernels"),
                                                                             env.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", _DRIVER_BINDINGS], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()


def test_a_paddle_process_launches_on_paddles_stream_and_device_even_with_torch_installed():
    pytest.importorskip("paddle")
    pytest.importorskip("torch")  # the case that went wrong: real torch importable beside Paddle
    stream, device = _driver_modules("paddle")
    assert stream.startswith("paddle") and device.startswith("paddle"), (stream, device)


def test_a_torch_process_launches_on_torchs_stream():
    pytest.importorskip("torch")
    stream, device = _driver_modules("torch")  # a CPU torch build has no raw-stream call: triton wraps torch's
    assert not stream.startswith("paddle") and device.startswith("torch"), (stream, device)


@pytest.mark.parametrize("framework,interpret,torch_installed,compat", [
    ("paddle", False, True, True),  # a GPU: Paddle's stream, whatever else is installed
    ("paddle", False, False, True),
    ("paddle", True, False, True),  # the interpreter needs some `torch`: Paddle's proxy
    ("paddle", True, True, False),  # tests run both frameworks in one process on real torch
    ("torch", False, True, False),
    ("torch", True, True, False),
])
def test_paddle_compat_is_enabled_exactly_where_triton_must_see_paddle(framework, interpret, torch_installed, compat):
    assert needs_paddle_compat(framework, interpret, torch_installed) is compat


def test_a_paddle_without_enable_compat_is_refused_naming_the_version_needed():
    with pytest.raises(ImportError, match=r"PaddlePaddle >= 3\.3 .*found 3\.2\.0.*paddlepaddle-gpu>=3\.3"):
        enable_paddle_compat(types.SimpleNamespace(__version__="3.2.0"))
