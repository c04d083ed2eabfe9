"""`ernie-openai --workers 2`: a supervisor and two worker processes on one listening socket, against a fake Triton
over real gRPC. Both workers answer, /metrics and /get_load are the whole shim's, SIGTERM drains and the supervisor
exits 0 with no worker left, a killed worker makes it exit 1, and ernie-serve refuses --workers without the shim."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fake_grpc_triton import FakeTritonServer, FakeTritonServicer, stream_response
from openai_shim_helpers import listening_socket

STARTUP_SECONDS = 90  # two interpreters importing the app on a loaded 2-core host


class _Servicer(FakeTritonServicer):
    """A model that streams `words=N pace=S` words (default 3 at once)."""

    async def ModelStreamInfer(self, request_iterator, context):
        request = await request_iterator.__anext__()
        names = [i.name for i in request.inputs]
        prompt = request.raw_input_contents[names.index("text_input")][4:].decode()
        words = int(m.group(1)) if (m := re.search(r"words=(\d+)", prompt)) else 3
        pace = float(m.group(1)) if (m := re.search(r"pace=([\d.]+)", prompt)) else 0.0
        for i in range(words):
            await asyncio.sleep(pace)
            await context.write(stream_response(f" w{i}", "length" if i == words - 1 else ""))
        async for _ in request_iterator:  # like Triton, end the stream once the client half-closes
            pass


@pytest.fixture(scope="module")
def triton_url():
    """The word-streaming model on a fake Triton over gRPC; yields its url."""
    with FakeTritonServer(_Servicer()) as server:
        yield server.url


class Shim:
    """`ernie-openai --workers N` in a subprocess, its log in a file; the port handed over (--fd) or, with
    `bind=True`, bound by the supervisor itself (--port 0) and read from its log."""

    def __init__(self, triton_url: str, log: Path, workers: int = 2, flags: tuple[str, ...] = (), bind: bool = False):
        self.log_path = log
        cmd = [sys.executable, "-m", "ernie_client.openai_server", "--workers", str(workers), "--triton-url",
               triton_url, "--log-level", "info", "--graceful-shutdown-seconds", "10", *flags]
        sock = None
        if bind:
            cmd += ["--port", "0"]
        else:
            sock = listening_socket()
            cmd += ["--fd", str(sock.fileno())]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         pass_fds=(sock.fileno(),) if sock else ())
        if sock is not None:
            self.port = sock.getsockname()[1]
            sock.close()
        try:
            started = self.wait_log(r"(\d+) workers \(pids ([\d ]+)\) serving http://[^:]+:(\d+)", STARTUP_SECONDS)
            self.pids = [int(p) for p in started.group(2).split()]
            self.port = int(started.group(3))
            self.wait_log(r"(?s)(Application startup complete.*){%d}" % workers, STARTUP_SECONDS)
        except BaseException:
            self.close()
            raise
        self.url = f"http://127.0.0.1:{self.port}"
        # the workers' metrics directory, from one's environment: gone once the supervisor has exited
        env = Path(f"/proc/{self.pids[0]}/environ").read_bytes().split(b"\0")
        self.metrics_dir = next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"PROMETHEUS_MULTIPROC_DIR="))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log())
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} in the shim's log (exit {self.proc.poll()}):\n{self.log()[-3000:]}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the supervisor did not exit in {timeout} s:\n{self.log()[-3000:]}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # drains, stops its workers and removes its metrics directory
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # its workers die with it (PR_SET_PDEATHSIG)
                self.proc.wait(10)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _wait_gone(pids: list[int], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"workers still alive: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.05)


@pytest.fixture
def shims(triton_url, tmp_path):
    started: list[Shim] = []

    def start(**kw) -> Shim:
        shim = Shim(triton_url, tmp_path / f"shim{len(started)}.log", **kw)
        started.append(shim)
        return shim

    yield start
    for shim in started:
        shim.close()
        _wait_gone(shim.pids)
        assert not os.path.exists(shim.metrics_dir)


def _complete(url: str, prompt: str = "words=3") -> str:
    """One completion on a connection of its own (each new connection may land on either worker)."""
    r = httpx.post(url + "/v1/completions", json={"model": "ernie", "prompt": prompt, "max_tokens": 50}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _samples(text: str, name: str) -> dict[str, float]:
    return {m.group(1) or "": float(m.group(2))
            for m in re.finditer(r"^" + re.escape(name) + r"(\{[^}]*\})? (\S+)$", text, re.M)}


def test_both_workers_answer_and_metrics_and_load_are_the_whole_shims(shims):
    shim = shims(flags=("--max-concurrency", "15"))
    sent = 0
    admitted: dict[str, float] = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(15):  # the kernel hands each new connection to whichever worker accepts first
            sent += sum(t == " w0 w1 w2" for t in pool.map(lambda _: _complete(shim.url, "words=3 pace=0.02"),
                                                            range(8)))
            admitted = _samples(httpx.get(shim.url + "/metrics", timeout=10).text,
                                "ernie_openai:worker_requests_admitted")
            if len(admitted) == 2 and all(admitted.values()):
                break
    assert sorted(admitted) == sorted(f'{{pid="{p}"}}' for p in shim.pids), admitted
    assert all(v > 0 for v in admitted.values()), f"one worker answered nothing of {sent}: {admitted}"
    assert sum(admitted.values()) == sent
    for _ in range(4):  # whichever worker answers /metrics, it counts both workers' requests
        text = httpx.get(shim.url + "/metrics", timeout=10).text
        assert _samples(text, "ernie_openai:requests_total") == {'{endpoint="/v1/completions",status="200"}': sent}
        assert _samples(text, "ernie_openai:e2e_request_latency_seconds_count") == {
            '{endpoint="/v1/completions"}': sent}
        assert _samples(text, "ernie_openai:requests_in_flight") == {"": 0.0}
    # every series a single process shows from the start is there (labelled ones appear with their first value)
    from ernie_client.openai.metrics import Metrics

    def series(page: str) -> set[str]:
        return set(re.findall(r"^(ernie_openai:[\w:]+)[ {]", page, re.M))

    assert series(Metrics().render().decode()) <= series(text)

    # streams held open on several connections: /get_load and /server_info speak for the whole shim
    body = {"model": "ernie", "prompt": "words=400 pace=0.05", "max_tokens": 500, "stream": True}
    with contextlib.ExitStack() as held:
        readers = []  # kept: a dropped line iterator closes its response
        for _ in range(5):
            c = held.enter_context(httpx.Client(timeout=30))
            s = held.enter_context(c.stream("POST", shim.url + "/v1/completions", json=body))
            assert s.status_code == 200
            readers.append(s.iter_lines())
            next(readers[-1])
        for _ in range(4):
            load = httpx.get(shim.url + "/get_load", timeout=10).json()
            assert load[0]["num_reqs"] == 5, load
        info = httpx.get(shim.url + "/server_info", timeout=10).json()
        assert info["max_concurrency"] == 15 and info["api_server_workers"] == 2
        # 8 slots a worker (ceil(15 / 2)): not "overloaded", whichever worker answers
        assert httpx.get(shim.url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    while httpx.get(shim.url + "/get_load", timeout=10).json()[0]["num_reqs"]:
        assert time.monotonic() < deadline, "the closed streams are still in flight"
        time.sleep(0.1)


def test_sigterm_drains_every_worker_and_the_supervisor_exits_0(shims):
    shim = shims()
    body = {"model": "ernie", "prompt": "words=60 pace=0.05", "max_tokens": 100, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", shim.url + "/v1/completions", json=body) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("data:")
        shim.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2
        while httpx.get(shim.url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "the workers did not start draining"
        # the idle worker drains too (it waits for the whole shim), so the port keeps answering 503
        for _ in range(6):
            r = httpx.get(shim.url + "/health", timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
        rest = [line for line in lines if line]  # the stream runs on to its end through the drain
    assert rest[-1] == "data: [DONE]" and sum(line.startswith("data: {") for line in rest) == 59, rest[-3:]
    assert shim.wait(40) == 0, shim.log()[-3000:]
    _wait_gone(shim.pids)
    assert not os.path.exists(shim.metrics_dir)
    assert "all 2 workers stopped" in shim.log()


def test_a_worker_that_dies_makes_the_supervisor_exit_1_and_stop_the_other(shims):
    shim = shims(bind=True)  # the supervisor binds the port itself and reports it
    assert _complete(shim.url) == " w0 w1 w2"
    os.kill(shim.pids[1], signal.SIGKILL)
    assert shim.wait(40) == 1
    _wait_gone(shim.pids)
    assert f"worker 1 (pid {shim.pids[1]}) killed by SIGKILL unexpectedly" in shim.log()
    assert not os.path.exists(shim.metrics_dir)
    with pytest.raises(httpx.ConnectError):
        httpx.get(shim.url + "/health", timeout=5)


def test_the_workers_die_with_a_killed_supervisor(shims):
    shim = shims()
    shim.proc.kill()
    shim.proc.wait(10)
    _wait_gone(shim.pids)  # PR_SET_PDEATHSIG: none is left holding the port
    shutil.rmtree(shim.metrics_dir)  # a killed supervisor cannot remove it
    with pytest.raises(httpx.ConnectError):
        httpx.get(shim.url + "/health", timeout=5)


def test_workers_flag_checks(capsys):
    from ernie_client.openai_server import parse_args
    from ernie_serve.cli.serve import build_parser, main, openai_flags

    assert parse_args([]).workers == 1
    with pytest.raises(SystemExit):
        parse_args(["--workers", "0"])
    assert "--workers must be >= 1" in capsys.readouterr().err
    parser = build_parser()
    args = parser.parse_args(["--openai-port", "9000", "--workers", "2", "--max-concurrency", "8"])
    assert openai_flags(parser, args) == ("--max-concurrency", "8", "--workers", "2")
    for argv, words in [(["--workers", "2"], "give --openai-port too"),
                        (["--openai-port", "9000", "--workers", "0"], "--workers must be >= 1")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err
