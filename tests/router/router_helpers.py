"""Helpers for the router tests: sglang-router as a process in front of replicas, and the replicas' own counters."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ernie_serve.ports import free_port  # the router binds its own ports: these stay reserved for this process

# Health checks each second, so a dead or draining replica leaves the rotation within seconds (three failed checks:
# a slow answer or two on a loaded host do not move a conversation), and workers are found as soon as they answer.
FAST_HEALTH = ["--health-check-interval-secs", "1", "--health-failure-threshold", "3", "--health-success-threshold",
               "1", "--worker-startup-check-interval", "1"]


class RouterProcess:
    """`python -m sglang_router.launch_router` on loopback ports of its own, logging to `log_path`."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 60.0):
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port), "--log-level", "info",
               *args]
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.expected = sum(1 for a in args if a.startswith("http"))
        try:
            self.wait_healthy(self.expected, timeout)
        except BaseException:
            self.stop()
            raise

    def healthy_workers(self) -> int:
        try:
            return int(httpx.get(self.url + "/readiness", timeout=2).json().get("healthy_workers", 0))
        except (httpx.HTTPError, ValueError):
            return 0

    def wait_healthy(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.healthy_workers() != n:
            assert self.proc.poll() is None, f"the router exited {self.proc.returncode}:\n{self.log()[-3000:]}"
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router did not see {n} healthy workers in {timeout:.0f} s:\n"
                                   f"{self.log()[-3000:]}")
            time.sleep(0.2)

    def workers(self) -> dict[str, bool]:
        """Worker URL -> healthy, as the router sees them."""
        return {w["url"]: w["is_healthy"] for w in httpx.get(self.url + "/workers", timeout=5).json()["workers"]}

    def log(self) -> str:
        """The router's log without its colour codes."""
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def shim_counters(url: str) -> dict[str, float]:
    """The shim's own counters: chat requests answered, prompt tokens and prompt tokens from the prefix cache."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out = {"chat": 0.0, "prompt": 0.0, "cached": 0.0}
    for name, labels, value in re.findall(r"^(ernie_openai:[\w:]+?)(\{[^}]*\})?\s+(\S+)$", text, re.M):
        if name == "ernie_openai:requests_total" and 'endpoint="/v1/chat/completions"' in labels:
            out["chat"] += float(value)
        elif name == "ernie_openai:prompt_tokens_total":
            out["prompt"] += float(value)
        elif name == "ernie_openai:cached_prompt_tokens_total":
            out["cached"] += float(value)
    return out
