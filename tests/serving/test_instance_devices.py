"""--data-parallel-size N on a GPU machine: each ernie_moe instance's engine gets its own GPUs (it used to build every
replica's tensors on GPU 0), without a GPU here: the machine's GPUs are named device nodes, and Triton's
instance arguments are the ones a real tritonserver 2.51 passes (KIND_CPU: `<model>_0_<k>`, device id 0)."""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from ernie_serve import devices
from ernie_serve.serving.instance_devices import instance_gpus, pin_instance_gpus

REPO = Path(__file__).resolve().parents[2]
EIGHT_GPUS = [f"/dev/nvidia{i}" for i in range(8)]


def _args(k: int, count: int, kind: str = "CPU", device_id: int = 0) -> dict[str, str]:
    config = {"name": "ernie_moe", "instance_group": [{"count": count, "kind": f"KIND_{kind}"}],
              "parameters": {}}
    return {"model_name": "ernie_moe", "model_version": "1", "model_instance_name": f"ernie_moe_0_{k}",
            "model_instance_kind": kind, "model_instance_device_id": str(device_id),
            "model_config": json.dumps(config)}


def test_replicas_take_disjoint_gpu_slices():
    assert [instance_gpus(_args(k, 2), 1, None, 8) for k in range(2)] == [["0"], ["1"]]
    assert [instance_gpus(_args(k, 2), 4, None, 8) for k in range(2)] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    # slices of what the parent was given, not of the machine's numbering
    visible = ["4", "5", "6", "7"]
    assert [instance_gpus(_args(k, 2), 2, visible, 8) for k in range(2)] == [["4", "5"], ["6", "7"]]


def test_a_kind_gpu_instance_starts_at_the_gpu_triton_placed_it_on():
    assert instance_gpus(_args(0, 1, "GPU", device_id=3), 1, None, 8) == ["3"]
    assert instance_gpus(_args(1, 2, "GPU", device_id=2), 2, None, 8) == ["2", "3"]


def test_a_single_instance_keeps_the_environment_as_it_is():
    env = {"CUDA_VISIBLE_DEVICES": "5"}
    assert pin_instance_gpus(_args(0, 1), 1, env, EIGHT_GPUS) is None and env == {"CUDA_VISIBLE_DEVICES": "5"}
    assert pin_instance_gpus(_args(1, 2), 1, {}, gpu_nodes=[]) is None  # no GPUs: nothing to hand out


def test_more_replicas_than_gpus_are_refused_naming_the_flags():
    with pytest.raises(ValueError, match="needs GPUs 4..7.*4 are visible.*--data-parallel-size"):
        instance_gpus(_args(1, 2), 4, ["0", "1", "2", "3"], 8)
    with pytest.raises(ValueError, match="does not end in its index"):
        instance_gpus({**_args(0, 2), "model_instance_name": "ernie_moe"}, 1, None, 8)


def _load_ernie_moe_model(monkeypatch, built: list[str]):
    """model_repository/ernie_moe/1/model.py with a stand-in for triton_python_backend_utils and an engine that only
    records the CUDA_VISIBLE_DEVICES it was built under."""
    pb_utils = types.ModuleType("triton_python_backend_utils")
    pb_utils.TritonModelException = RuntimeError
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb_utils)
    spec = importlib.util.spec_from_file_location("ernie_moe_model", REPO / "model_repository/ernie_moe/1/model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import os

    monkeypatch.setattr(module, "engine_model", lambda *a, **k: built.append(os.environ.get("CUDA_VISIBLE_DEVICES")))
    monkeypatch.setattr(module, "EngineMetrics", lambda *a, **k: None)
    return module


def test_two_ernie_moe_instances_build_their_engines_on_different_gpus(monkeypatch):
    built: list[str] = []
    module = _load_ernie_moe_model(monkeypatch, built)
    monkeypatch.setattr(devices, "nvidia_device_nodes", lambda: EIGHT_GPUS)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "unset at the end")  # recorded first: teardown restores the original
    for k in range(2):  # each instance is its own stub process: each starts from the parent's environment
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        module.TritonPythonModel().initialize(_args(k, 2))
    assert built == ["0", "1"]
