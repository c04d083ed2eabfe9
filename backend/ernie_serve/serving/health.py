"""Whether a running tritonserver can still serve, seen from outside it (the launcher's watch).

tritonserver 2.51 keeps reporting a model ready after its python stub died (measured: SIGKILL of the
ernie_moe stub leaves /v2/models/ernie/ready at 200, in-flight streams hang and new requests fail),
and a python model cannot mark itself not ready. So the launcher looks for itself: every python stub
it saw at start must still be a live child of the server, and every engine must report
ernie:engine_healthy 1 on the metrics port.
"""
from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
_SAMPLE = re.compile(r"^(ernie:[\w:]+)(\{[^}]*\})?\s+([-+0-9.eEinfa]+)$")


@dataclass(frozen=True)
class Stub:
    """One python backend stub process: a model instance (e.g. ernie_moe_0_0) of the server."""

    instance: str
    model: str
    pid: int


def process_state(pid: int | str) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc/<pid>/stat, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
    except OSError:
        return None
    return fields[0], int(fields[1])


def python_stubs(server_pid: int) -> list[Stub]:
    """The live (non-zombie) python stubs that tritonserver `server_pid` started.

    A stub's argv is: stub, model.py path, shm region, sizes, parent pid, backend dir, ..., instance name.
    """
    stubs = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        stat = process_state(entry.name)
        if stat is None:
            continue
        state, ppid = stat
        if ppid != server_pid or state == "Z" or not argv[0].endswith(STUB_BINARY.encode()) or len(argv) < 9:
            continue
        model_py = Path(argv[1].decode(errors="replace"))
        stubs.append(Stub(argv[8].decode(errors="replace"), model_py.parent.parent.name, int(entry.name)))
    return sorted(stubs, key=lambda s: s.instance)


def engine_cores(stubs: list[Stub]) -> dict[str, int]:
    """instance -> pid of the engine core process each of these stubs started (engine/core_process.py)."""
    by_pid = {s.pid: s.instance for s in stubs}
    cores = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        stat = process_state(entry.name)
        if stat is not None and stat[1] in by_pid and b"ernie_serve.engine.core_process" in argv:
            cores[by_pid[stat[1]]] = int(entry.name)
    return cores


def ernie_samples(metrics_url: str, timeout: float = 2.0) -> list[tuple[str, str, float]]:
    """Every ernie:* sample on the metrics port as (name, labels, value)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as r:
        text = r.read().decode()
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out.append((m.group(1), m.group(2) or "", float(m.group(3))))
    return out


def unhealthy_engines(samples: list[tuple[str, str, float]]) -> list[str]:
    """The label sets of the engines whose ernie:engine_healthy gauge is 0."""
    return [labels for name, labels, value in samples if name == "ernie:engine_healthy" and value == 0]


def requests_in_engines(samples: list[tuple[str, str, float]]) -> int:
    """Requests running or waiting, summed over the engine instances."""
    return int(sum(v for name, _, v in samples if name in ("ernie:num_requests_running", "ernie:num_requests_waiting")))


def process_alive(pid: int) -> bool:
    stat = process_state(pid)
    return stat is not None and stat[0] != "Z"


def _died(stubs: list[Stub]) -> str:
    return "python stub " + ", ".join(f"{s.instance} (pid {s.pid})" for s in stubs) + " died"


class HealthWatch:
    """Remembers the stubs a ready server runs; `problem()` says what broke since, or None."""

    def __init__(self, server_pid: int, metrics_url: str, metrics_tries: int = 5):
        """`metrics_tries`: scrapes in a row that may fail before that counts as broken (a loaded
        2-core host can be slow to answer one)."""
        self.server_pid = server_pid
        self.metrics_url = metrics_url
        self.metrics_tries = metrics_tries
        self._metrics_failures = 0
        self.stubs = python_stubs(server_pid)

    def problem(self) -> str | None:
        if not process_alive(self.server_pid):
            # a stub's death can take tritonserver down before this watch looks again (measured: SIGKILL of the
            # ernie_moe stub, then a backtrace from tritonserver): name the stubs already gone as well
            dead = [s for s in self.stubs if not process_alive(s.pid)]
            return f"tritonserver (pid {self.server_pid}) exited" + (f"; {_died(dead)}" if dead else "")
        alive = {s.pid for s in python_stubs(self.server_pid)}
        dead = [s for s in self.stubs if s.pid not in alive]
        if dead:
            return _died(dead)
        try:
            bad = unhealthy_engines(ernie_samples(self.metrics_url))
        except OSError as e:
            self._metrics_failures += 1
            return f"metrics port not answering: {e}" if self._metrics_failures >= self.metrics_tries else None
        self._metrics_failures = 0
        if bad:
            return "engine reports unhealthy: " + ", ".join(bad)
        return None

    def engine_pids(self) -> list[int]:
        """The stubs that run an engine (ernie_moe instances)."""
        return [s.pid for s in self.stubs if s.model == "ernie_moe"]

