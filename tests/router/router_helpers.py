"""Helpers for the router tests: sglang-router as a process in front of replicas, and the replicas' own counters."""
from __future__ import annotations

import errno
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx

from ernie_serve.ports import address_in_use, listeners_owned_by, session_pids, start_on_free_ports

# Health checks each second, so a dead or draining replica leaves the rotation within seconds (three failed checks:
# a slow answer or two on a loaded host do not move a conversation), and workers are found as soon as they answer.
FAST_HEALTH = ["--health-check-interval-secs", "1", "--health-failure-threshold", "3", "--health-success-threshold",
               "1", "--worker-startup-check-interval", "1"]


def launch_router(args: list[str], port: int, metrics: int, log_path: Path) -> subprocess.Popen:
    """sglang-router on 127.0.0.1:`port` (its Prometheus metrics on `metrics`) in a session of its own, logging to
    `log_path`; not yet listening when this returns (see `router_owns`)."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics), "--log-level", "info", *args]
    with open(log_path, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def router_owns(proc: subprocess.Popen, ports: tuple[int, ...], log: Callable[[], str], timeout: float) -> None:
    """Return once every socket listening on `ports` is one of the router's (`proc`, started in a session of its
    own); OSError EADDRINUSE when it could not have them (it exited saying "already in use"), so that
    `start_on_free_ports` starts it again on other ports.

    The router takes only port numbers (port 0 is refused, and it cannot serve on a handed-over socket), so its ports
    are picked and verified: it binds them itself and exits when one is taken."""
    deadline = time.monotonic() + timeout
    while not all(listeners_owned_by(port, session_pids(proc.pid)) for port in ports):
        if proc.poll() is not None:
            text = log()
            if address_in_use(text):
                raise OSError(errno.EADDRINUSE, f"the router could not bind {ports}: {text[-500:]}")
            raise RuntimeError(f"the router exited {proc.returncode} before listening on {ports}:\n{text[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router did not listen on {ports} in {timeout:.0f} s:\n{log()[-3000:]}")
        time.sleep(0.2)


class RouterProcess:
    """`python -m sglang_router.launch_router` on loopback ports of its own (verified: see `router_owns`), logging to
    `log_path`."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 60.0):
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.port, self.metrics_port = start_on_free_ports(lambda port, metrics: self._launch(args, port, metrics),
                                                           count=2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.expected = sum(1 for a in args if a.startswith("http"))
        try:
            self.wait_healthy(self.expected, timeout)
        except BaseException:
            self.stop()
            raise

    def _launch(self, args: list[str], port: int, metrics: int) -> tuple[int, int]:
        """The router on `port` (and its metrics on `metrics`), returned once both are its own; stopped otherwise."""
        self.proc = launch_router(args, port, metrics, self.log_path)
        try:
            router_owns(self.proc, (port, metrics), self.log, timeout=60)
        except BaseException:
            self.stop()
            raise
        return port, metrics

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
        if self.proc is not None and self.proc.poll() is None:
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
