"""Find a tritonserver, prepare what it needs, start it on the rendered repository, wait, stop.

On the NGC image `tritonserver` is on PATH with its backends in /opt/tritonserver/backends. Elsewhere
the nvidia-pytriton wheel has one: its python backend's stub for the running Python is copied into a
backends folder of the run directory, LD_LIBRARY_PATH gets the wheel's libraries, and PATH starts
with this Python's bin/. That last point is what makes the stub see the venv: the stub's embedded
interpreter ignores PYTHONPATH (measured: isolated config) but locates its prefix from `python3` on
PATH, so with a venv's bin first it reads pyvenv.cfg and the venv's site-packages, .pth files
included (the editable install's finder works).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..paths import repo_root
from .repository import render_repository


@dataclass
class TritonInstall:
    binary: Path
    backend_dir: Path | None  # None: the binary's own default (/opt/tritonserver/backends)
    lib_dir: Path | None
    stub_dir: Path | None  # python_backend_stubs/<major.minor>/ of the wheel


def find_tritonserver() -> TritonInstall:
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), None, None, None)
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no tritonserver on PATH and the nvidia-pytriton wheel is not installed; "
                                "run scripts/setup.sh or use the NGC tritonserver image")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.exists():
        raise FileNotFoundError(f"{binary} is missing from the nvidia-pytriton wheel")
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / ver
    if not (stub / "triton_python_backend_stub").exists():
        raise FileNotFoundError(f"nvidia-pytriton has no python backend stub for Python {ver}")
    return TritonInstall(binary, root / "backends", root.parent.parent / "nvidia_pytriton.libs", stub)


def prepare_backends(install: TritonInstall, run_dir: Path) -> Path | None:
    """A backends/ folder whose python backend runs the stub built for this Python."""
    if install.backend_dir is None:
        return None
    dst = run_dir / "backends"
    py = dst / "python"
    py.mkdir(parents=True, exist_ok=True)
    for f in (install.backend_dir / "python").iterdir():
        if f.is_file():
            shutil.copy2(f, py / f.name)
    shutil.copy2(install.stub_dir / "triton_python_backend_stub", py / "triton_python_backend_stub")
    caches = install.backend_dir.parent / "caches"
    if caches.exists() and not (run_dir / "caches").exists():
        shutil.copytree(caches, run_dir / "caches")
    return dst


def server_env(install: TritonInstall) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    libs = [str(install.lib_dir)] if install.lib_dir else []
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).exists():
        libs.append(libdir)  # the stub then runs on this Python's own libpython
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    # For tools that do honour PYTHONPATH (the OpenAI shim subprocess, a plain stub elsewhere).
    root = repo_root()
    paths = [str(root / d) for d in ("backend", "kernels", "client")] if root else []
    paths += [p for p in sysconfig.get_paths().values() if p.endswith("site-packages")][:1]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_repository() -> Path:
    root = repo_root()
    if root is None:
        raise FileNotFoundError("no model_repository/ next to the package; pass repository=")
    return root / "model_repository"


class TritonServer:
    """A tritonserver process on a rendered copy of the repository; a context manager."""

    def __init__(self, settings: dict[str, str] | None = None, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, host: str = "127.0.0.1", repository: Path | None = None,
                 run_dir: Path | None = None, engine_instances: int | None = None,
                 max_inflight_requests: int | None = None, openai_port: int | None = None,
                 exit_timeout: int = 15, extra_args: tuple[str, ...] = (), log_to_console: bool = False):
        self.settings = dict(settings or {})
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.host = host
        self.repository = Path(repository) if repository else default_repository()
        self._own_run_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="ernie-serve-"))
        self.engine_instances = engine_instances
        self.max_inflight_requests = max_inflight_requests
        self.openai_port = openai_port
        self.exit_timeout = exit_timeout
        self.extra_args = tuple(extra_args)
        self.log_to_console = log_to_console
        self.proc: subprocess.Popen | None = None
        self.openai_proc: subprocess.Popen | None = None
        self.log_path = self.run_dir / "tritonserver.log"
        self.startup_seconds: float | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self, install: TritonInstall, repo: Path, backends: Path | None) -> list[str]:
        cmd = [str(install.binary), "--model-repository", str(repo),
               "--http-address", self.host, "--http-port", str(self.http_port),
               "--grpc-address", self.host, "--grpc-port", str(self.grpc_port),
               "--metrics-address", self.host, "--metrics-port", str(self.metrics_port),
               "--allow-metrics", "true", "--exit-timeout-secs", str(self.exit_timeout),
               "--strict-readiness", "true"]
        if backends is not None:
            cmd += ["--backend-directory", str(backends)]
            if (self.run_dir / "caches").exists():
                cmd += ["--cache-directory", str(self.run_dir / "caches")]
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 300.0) -> "TritonServer":
        t0 = time.monotonic()
        install = find_tritonserver()
        repo = render_repository(self.repository, self.run_dir / "model_repository", self.settings,
                                 self.engine_instances, self.max_inflight_requests)
        backends = prepare_backends(install, self.run_dir)
        out = None if self.log_to_console else open(self.log_path, "wb")
        # A session of its own: stopping the server reaches the python stubs it forked, and a
        # Ctrl-C in the launcher's terminal reaches the launcher first, which then stops it in order.
        self.proc = subprocess.Popen(self.command(install, repo, backends), env=server_env(install),
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if out is not None:
            out.close()
        try:
            self.wait_ready(timeout - (time.monotonic() - t0))
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        if self.openai_port is not None:
            self._start_openai(install)
        return self

    def _start_openai(self, install: TritonInstall) -> None:
        if importlib.util.find_spec("ernie_client.openai_server") is None:
            print("[ernie-serve] --openai-port given but ernie_client.openai_server is not available; skipped",
                  file=sys.stderr)
            return
        self.openai_proc = subprocess.Popen(
            [sys.executable, "-m", "ernie_client.openai_server", "--triton-url", self.grpc_url,
             "--port", str(self.openai_port)], env=server_env(install), start_new_session=True)

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + max(timeout, 1.0)
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM: Triton stops accepting, waits for in-flight requests (exit_timeout), unloads.

        Idle, this takes ~4 s on the 2-core box (the python stubs' finalize and exit). It takes the
        whole exit_timeout when a request is really in flight, and also while a client still holds a
        gRPC stream open (measured: the ensemble then stays "live" after its last request, and past the
        timeout tritonserver still hangs in its gRPC shutdown, hence the kill 5 s later).
        """
        timeout = timeout if timeout is not None else self.exit_timeout + 5
        for proc in (self.openai_proc, self.proc):
            if proc is None or proc.poll() is not None:
                continue
            # Only the server itself: it unloads the models, whose stubs then finalize (aborting in-flight
            # requests with CANCELLED + FINAL). A signal to the whole group would kill the stubs first.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        code = self.proc.returncode if self.proc is not None else None
        if self.proc is not None:
            try:  # stubs left behind by a killed server
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return code

    def cleanup(self) -> None:
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()
