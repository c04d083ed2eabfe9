"""`ernie-openai`: the OpenAI-compatible server in front of a Triton serving the `ernie` ensemble.

    ernie-openai --triton-url localhost:8001 --port 9000 [--host 127.0.0.1] [--model-name ernie]
                 [--served-model-name NAME] [--api-key KEY] [--max-concurrency N] [--max-waiting-time S]
                 [--request-timeout S] [--tokenizer DIR [--max-model-len N] [--chat-template T]]
                 [--graceful-shutdown-seconds S] [--timeout-keep-alive S] [--triton-metrics-url URL] [--workers N]
                 [--engine-control auto|off]

With --workers N > 1 this process is a supervisor: it starts N worker processes (this module again, with the
hidden --worker-index) that serve the same listening socket, each its own uvicorn, event loop and Triton client,
forwards SIGTERM / SIGINT to them (each drains as one process does), and exits 1 when one dies unexpectedly.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .openai import ServerConfig, create_app
from .openai.replica import draining_server

# An idle keep-alive connection must outlive the client pools' idle expiry (httpx 5 s, aiohttp 15 s, a load
# balancer's ~60 s), so that the client always closes first. uvicorn's 5 s did not, under load: its timer fires in
# the same event-loop pass that lags behind a request already sent on the connection, and closing a socket with that
# request unread resets it (the client's ReadError, no response byte). 75 s is nginx's keepalive_timeout.
# Re-check: .venv/bin/python -m pytest -p no:cacheprovider tests/openai/test_keep_alive.py
KEEP_ALIVE_SECONDS = 75.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ernie-openai", description=__doc__.split("\n\n")[0])
    p.add_argument("--triton-url", default="localhost:8001", help="Triton gRPC endpoint (host:port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--fd", type=int, default=None,
                   help="serve on this inherited listening socket instead of binding --host/--port (ernie-serve "
                        "binds it before starting the shim, so the port cannot be taken in between)")
    p.add_argument("--model-name", default="ernie", help="the Triton ensemble to call")
    p.add_argument("--served-model-name", default=None, help="the name clients use in 'model' (default: --model-name)")
    p.add_argument("--api-key", default=os.environ.get("ERNIE_OPENAI_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (env ERNIE_OPENAI_API_KEY)")
    p.add_argument("--max-concurrency", type=int, default=512,
                   help="generation requests served at once; more are refused with 429")
    p.add_argument("--max-waiting-time", type=float, default=None,
                   help="seconds a request over --max-concurrency waits for a slot before a 408 (-1: no limit; "
                        "default: refused at once with 429)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take before it is cancelled with 504 (default: no limit)")
    p.add_argument("--graceful-shutdown-seconds", type=float, default=10.0,
                   help="on SIGTERM, how long open streams may run on before they are cut")
    p.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_SECONDS,
                   help="seconds an idle keep-alive connection stays open (uvicorn's own default is 5). Keep it "
                        "above every client pool's idle expiry (httpx 5 s, aiohttp 15 s, load balancers ~60 s): "
                        "a shorter one can close a connection whose next request the busy server has not read "
                        f"yet, and that request is lost (default {KEEP_ALIVE_SECONDS:g})")
    p.add_argument("--tokenizer", default=None,
                   help="the served model's directory (its tokenizer) for /tokenize, /detokenize, /tokenizer_info")
    p.add_argument("--max-model-len", type=int, default=None, help="the server's, reported by /tokenize")
    p.add_argument("--chat-template", default=None, help="the server's --chat-template, if it has one")
    p.add_argument("--triton-metrics-url", default=None,
                   help="Triton's metrics page (http://host:8002/metrics): the engines' load in /get_load")
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes serving the one listening socket, each with its own event loop and "
                        "Triton connection (FastDeploy's --workers): more CPU for the shim. --max-concurrency is "
                        "split: each worker admits ceil(--max-concurrency / --workers), the kernel spreads "
                        "connections among them; /metrics, /get_load and /health stay the whole shim's "
                        "(default 1: one process)")
    p.add_argument("--engine-control", choices=("off", "auto"), default="off",
                   help="how a stream whose client left ends: 'auto' aborts it in the engines when --triton-url is "
                        "this host's (their control sockets, found by tritonserver's port) and reads it to its end, "
                        "with no gRPC cancellation (tritonserver 2.51 can deadlock on one); 'off' cancels it over "
                        "gRPC (default off; ernie-serve passes auto)")
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)  # set by the supervisor
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.max_waiting_time is not None and args.max_waiting_time <= 0 and args.max_waiting_time != -1:
        p.error(f"--max-waiting-time must be > 0 seconds or -1 (no limit), got {args.max_waiting_time}")
    if args.graceful_shutdown_seconds < 0:
        p.error(f"--graceful-shutdown-seconds must be >= 0, got {args.graceful_shutdown_seconds}")
    if args.timeout_keep_alive <= 0:
        p.error(f"--timeout-keep-alive must be > 0 seconds, got {args.timeout_keep_alive}")
    if args.request_timeout is not None and args.request_timeout <= 0:
        p.error(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    return args


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(triton_url=args.triton_url, model_name=args.model_name,
                        served_model_name=args.served_model_name, api_key=args.api_key,
                        max_concurrency=args.max_concurrency, request_timeout=args.request_timeout,
                        max_waiting_time=args.max_waiting_time, tokenizer=args.tokenizer,
                        max_model_len=args.max_model_len, chat_template=args.chat_template,
                        triton_metrics_url=args.triton_metrics_url, workers=args.workers,
                        engine_control=args.engine_control)


def uvicorn_config(args: argparse.Namespace, app):
    """uvicorn's Config for the shim's flags: the one place its server settings come from."""
    import uvicorn

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          timeout_graceful_shutdown=args.graceful_shutdown_seconds,
                          timeout_keep_alive=args.timeout_keep_alive)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    worker = "" if args.worker_index is None else f"[worker {args.worker_index}] "
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {worker}%(name)s: %(message)s")
    if args.workers > 1 and args.worker_index is None:
        sys.exit(Supervisor(args, argv).run())
    # the first SIGTERM drains: /health 503 and new requests refused while running ones finish (openai/replica.py)
    server = draining_server(uvicorn_config(args, create_app(config_from_args(args))))
    try:
        server.run(sockets=None if args.fd is None else [socket.socket(fileno=args.fd)])
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(3)  # uvicorn.run's status for a server that never started


PR_SET_PDEATHSIG = 1
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _worker_preexec(supervisor_pid: int) -> None:
    """In a worker between fork and exec: SIGKILL it when the supervisor dies (no orphan holds the port), and let
    it hear the stop signals the supervisor blocks while it starts the workers."""
    os.setpgid(0, 0)  # a process group of its own (Popen's process_group= needs Python 3.11; the NGC image has 3.10)
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != supervisor_pid:  # the supervisor died before prctl took effect
        os._exit(1)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def _why(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


class Supervisor:
    """--workers N: N copies of this server on one listening socket, started, signalled and watched from here.

    The workers are in process groups of their own, so a terminal's Ctrl-C reaches them once, through here (twice
    would skip the drain), and die with this process (PR_SET_PDEATHSIG): whoever stops the supervisor stops them."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.args, self.argv = args, argv
        self.log = logging.getLogger("ernie_client.openai_server")
        self.workers: dict[int, int] = {}   # pid -> worker index, the live ones
        # held, never polled: a dropped Popen joins subprocess's own reaping list, and that could take a worker's
        # exit status before _watch's waitpid sees it
        self.procs: list[subprocess.Popen] = []
        self.signals: list[int] = []        # stop signals received (and forwarded)
        self.failed: list[str] = []

    def _socket(self) -> socket.socket:
        if self.args.fd is not None:
            return socket.socket(fileno=self.args.fd)
        family = socket.AF_INET6 if ":" in self.args.host else socket.AF_INET
        return socket.create_server((self.args.host, self.args.port), family=family, backlog=2048)

    def _forward(self, signum: int, _frame) -> None:
        self.signals.append(signum)
        for pid in list(self.workers):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        """Serve until stopped; 0 when every worker ended on a forwarded stop signal, else 1."""
        n = self.args.workers
        sock = self._socket()
        host, port = sock.getsockname()[:2]
        metrics_dir = tempfile.mkdtemp(prefix="ernie-openai-metrics-")
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=metrics_dir)
        self_pid = os.getpid()
        for signum in _STOP_SIGNALS:
            signal.signal(signum, self._forward)
        try:
            # blocked while starting them: a stop signal now is forwarded to all once they exist
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
            try:
                for i in range(n):
                    cmd = [sys.executable, "-m", "ernie_client.openai_server", *self.argv,
                           "--fd", str(sock.fileno()), "--worker-index", str(i)]
                    proc = subprocess.Popen(cmd, env=env, pass_fds=(sock.fileno(),), stdin=subprocess.DEVNULL,
                                            preexec_fn=lambda: _worker_preexec(self_pid))
                    self.procs.append(proc)
                    self.workers[proc.pid] = i
            finally:
                sock.close()  # the workers hold it now: once they are gone, connections are refused, not queued
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            per = -(-self.args.max_concurrency // n)
            self.log.info("%d workers (pids %s) serving http://%s:%d; --max-concurrency %d split: %d each", n,
                          " ".join(map(str, self.workers)), host, port, self.args.max_concurrency, per)
            self._watch(metrics_dir)
        finally:
            for pid in list(self.workers):  # only after a failure to start or to stop them
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
            shutil.rmtree(metrics_dir, ignore_errors=True)
        if self.failed:
            self.log.error("exiting with status 1: %s", "; ".join(self.failed))
            return 1
        self.log.info("all %d workers stopped", n)
        return 0

    def _watch(self, metrics_dir: str) -> None:
        """Reap the workers as they end; the first unexpected end stops the others (they drain), and after
        twice --graceful-shutdown-seconds (a drain, then uvicorn's own graceful stop) and a margin, whoever is left
        is killed."""
        from prometheus_client.multiprocess import mark_process_dead

        deadline = None
        # a drain, then uvicorn's graceful shutdown, may each take --graceful-shutdown-seconds
        grace = 2 * self.args.graceful_shutdown_seconds + 10
        while self.workers:
            if deadline is None and self.signals:
                deadline = time.monotonic() + grace
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if deadline is not None and time.monotonic() > deadline:
                    self.failed.append(f"workers {sorted(self.workers.values())} still running {grace:g} s "
                                       "after the stop signal: killed")
                    return
                time.sleep(0.1)
                continue
            index = self.workers.pop(pid, None)
            if index is None:
                continue
            mark_process_dead(pid, metrics_dir)
            code = os.waitstatus_to_exitcode(status)
            if self.signals and code in (0, -signal.SIGTERM, -signal.SIGINT):
                self.log.info("worker %d (pid %d) stopped", index, pid)
                continue
            why = f"worker {index} (pid {pid}) {_why(status)}" + ("" if self.signals else " unexpectedly")
            self.log.error("%s; stopping the other workers", why)
            self.failed.append(why)
            if not self.signals:
                self._forward(signal.SIGTERM, None)


if __name__ == "__main__":
    main()
