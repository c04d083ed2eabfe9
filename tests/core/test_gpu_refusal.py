"""execution_backend auto on a machine that shows NVIDIA GPUs its tensor framework cannot use: refused at start-up,
naming the framework build and what to install, instead of serving on the CPU without a word.

The machine's view is faked (a stand-in /dev, a stand-in nvidia-smi on PATH, CUDA_VISIBLE_DEVICES); the framework
and the refusal are the real ones, so on a box whose framework does see a GPU the refusal cases are skipped."""
from __future__ import annotations

import stat
from pathlib import Path

import pytest

from ernie_serve import devices
from ernie_serve.config import EngineConfig
from ernie_serve.engine.executor_factory import resolve_backend

framework_sees_a_gpu = pytest.mark.skipif(devices.gpu_visible(), reason="the installed framework sees a real GPU")


@pytest.fixture
def machine(tmp_path: Path, monkeypatch):
    """A stand-in machine: an empty /dev and a PATH with no nvidia-smi, which the tests then fill in."""
    dev = tmp_path / "dev"
    bin_dir = tmp_path / "bin"
    dev.mkdir()
    bin_dir.mkdir()
    monkeypatch.setattr(devices, "NVIDIA_DEVICE_DIR", dev)
    monkeypatch.setenv("PATH", str(bin_dir))  # this box's own nvidia-smi, if any, is out of sight
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    class Machine:
        def device_nodes(self, *names: str) -> None:
            for name in names:
                (dev / name).touch()

        def nvidia_smi(self, listing: str) -> None:
            smi = bin_dir / "nvidia-smi"
            smi.write_text(f"#!/bin/sh\nprintf '%s\\n' '{listing}'\n")  # printf: a builtin, PATH holds no cat
            smi.chmod(smi.stat().st_mode | stat.S_IEXEC)

    return Machine()


def backend_when_nothing_is_refused() -> str:
    """What auto picks where the machine shows no GPU: the reference backend (kernels where the framework sees one)."""
    return "kernels" if devices.gpu_visible() else "reference"


H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"


def test_a_machine_without_nvidia_gpus_shows_none(machine):
    machine.device_nodes("nvidiactl", "nvidia-uvm")  # driver control nodes, not GPUs
    assert devices.nvidia_gpus_on_machine() == []


def test_device_nodes_nvidia_smi_and_cuda_visible_devices_each_show_gpus(machine, monkeypatch):
    machine.device_nodes("nvidia0", "nvidia1", "nvidiactl")
    assert devices.nvidia_gpus_on_machine() == [f"device nodes {devices.NVIDIA_DEVICE_DIR / 'nvidia0'}, "
                                                f"{devices.NVIDIA_DEVICE_DIR / 'nvidia1'}"]
    for node in ("nvidia0", "nvidia1"):
        (devices.NVIDIA_DEVICE_DIR / node).unlink()
    machine.nvidia_smi(H100)
    assert devices.nvidia_gpus_on_machine() == [f"nvidia-smi -L: {H100}"]
    machine.nvidia_smi("No devices were found")
    assert devices.nvidia_gpus_on_machine() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert devices.nvidia_gpus_on_machine() == ["CUDA_VISIBLE_DEVICES=0,1"]


@pytest.mark.parametrize("hidden", ["", "-1", " -1 ", "-1,0"])
def test_cuda_visible_devices_empty_or_minus_one_means_no_gpus(machine, monkeypatch, hidden):
    machine.device_nodes("nvidia0")
    machine.nvidia_smi(H100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    assert devices.nvidia_gpus_on_machine() == []
    assert resolve_backend(EngineConfig()) == backend_when_nothing_is_refused()



@framework_sees_a_gpu
def test_auto_refuses_a_gpu_machine_whose_paddle_is_a_cpu_build(machine, monkeypatch):
    if not devices.installed("paddle"):
        pytest.skip("Paddle is not installed")
    monkeypatch.setenv(devices.FRAMEWORK_ENV, "paddle")
    machine.device_nodes("nvidia0")
    machine.nvidia_smi(H100)
    with pytest.raises(ValueError) as refused:
        resolve_backend(EngineConfig())
    message = str(refused.value)
    assert "execution_backend auto: this machine shows NVIDIA GPUs" in message
    assert H100 in message and "nvidia0" in message
    assert "CPU build" in message and "paddlepaddle" in message  # the build, as installed
    assert 'pip install "ernie-triton[gpu]"' in message and devices.PADDLE_GPU_INDEX in message
    assert "--execution-backend reference" in message


@framework_sees_a_gpu
def test_auto_refuses_a_gpu_machine_whose_torch_has_no_cuda(machine, monkeypatch):
    if not devices.installed("torch"):
        pytest.skip("torch is not installed")
    monkeypatch.setenv(devices.FRAMEWORK_ENV, "torch")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES=0\) but the installed tensor framework cannot use "
                                         r"them: torch \S+ \(built without CUDA\)") as refused:
        resolve_backend(EngineConfig())
    assert devices.TORCH_CUDA_INDEX in str(refused.value)


@framework_sees_a_gpu
def test_reference_still_runs_on_the_cpu_on_purpose(machine):
    machine.device_nodes("nvidia0")
    machine.nvidia_smi(H100)
    assert resolve_backend(EngineConfig(execution_backend="reference")) == "reference"


def test_auto_on_a_machine_without_gpus_is_the_reference_backend(machine):
    assert resolve_backend(EngineConfig()) == backend_when_nothing_is_refused()


@framework_sees_a_gpu
def test_the_server_refuses_before_tritonserver_starts(machine, monkeypatch, capsys):
    from ernie_serve.cli.serve import main
    from ernie_serve.serving import launcher

    def must_not_start(*_args, **_kwargs):
        raise AssertionError("tritonserver was started")

    monkeypatch.setattr(launcher.TritonServer, "start", must_not_start)
    machine.device_nodes("nvidia0")
    assert main(["--execution-backend", "auto"]) == 2
    err = capsys.readouterr().err
    assert "ernie-serve: execution_backend auto: this machine shows NVIDIA GPUs" in err
    assert "cannot use them" in err
