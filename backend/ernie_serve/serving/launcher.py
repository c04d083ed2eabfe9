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
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..paths import repo_root
from ..ports import free_port, port_in_use  # noqa: F401  (scripts import them from here)
from ..ports import address_in_use, listeners_owned_by, listening_socket, session_pids
from .control import listener_addresses, send_drain
from .health import STUB_BINARY, HealthWatch, ernie_samples, requests_in_engines
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
    sources = [f for f in (install.backend_dir / "python").iterdir() if f.is_file() and f.name != STUB_BINARY]
    for src in sources + [install.stub_dir / STUB_BINARY]:
        if not (py / src.name).exists():  # a restart reuses them (a dying stub's binary is busy)
            shutil.copy2(src, py / src.name)
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


def load_failures(log: str) -> list[tuple[str, str]]:
    """(model, reason) for each model tritonserver's status table shows UNAVAILABLE: the cause of a failed
    start, which the log otherwise buries above the table and ends with a generic 'failed to load all models'."""
    out = []
    for line in log.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = line.strip().strip("|").split("|", 2)  # model | version | status (which may hold a '|')
        status = cells[2].strip() if len(cells) == 3 else ""
        if status.startswith("UNAVAILABLE:"):
            model = cells[0].strip()
            reason = status.removeprefix("UNAVAILABLE:").strip()
            for prefix in ("Internal:", "TritonModelException:", f"{model}:"):
                reason = reason.removeprefix(prefix).strip()
            out.append((model, reason))
    return out


def fd_log_dir() -> Path | None:
    """FD_LOG_DIR, created; None when unset."""
    value = os.environ.get("FD_LOG_DIR", "").strip()
    if not value:
        return None
    path = Path(value).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"FD_LOG_DIR={value!r}: cannot create it ({e.strerror})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"FD_LOG_DIR={value!r}: not writable")
    return path


def default_repository() -> Path:
    root = repo_root()
    if root is None:
        raise FileNotFoundError("no model_repository/ next to the package; pass repository=")
    return root / "model_repository"


# Triton APIs no client of this product needs; any client could otherwise register the python backend's
# own shared-memory region (its name is in `ps`), load models or turn on tracing. Health stays open.
ADMIN_APIS = "shared-memory,model-repository,logging,trace"
CLIENT_APIS = "inference,metadata,model-config,statistics"
ADMIN_KEY_HEADER = "admin-key"


def restricted_api_args(admin_api_key: str, api_key: str | None) -> list[str]:
    """tritonserver flags that require a header for the admin APIs, and `Authorization: Bearer <api_key>`
    for the rest when an API key is set (gRPC clients send it as `triton-grpc-protocol-authorization`)."""
    args = []
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        args.append(f"{flag}={ADMIN_APIS}:{ADMIN_KEY_HEADER}={admin_api_key}")
        if api_key:
            args.append(f"{flag}={CLIENT_APIS}:authorization=Bearer {api_key}")
    return args


# Kills a process group once its stdin reaches EOF, i.e. once the launcher is gone, however it went.
# PR_SET_PDEATHSIG on tritonserver is not enough: its python stubs do not inherit it, and under load
# they outlive a killed server (measured: stubs busy with a stream stayed up, holding memory).
_REAPER = """
import os, signal, sys
sys.stdin.read()
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except ProcessLookupError:
    pass
"""


class _Child:
    """A child started in a session of its own, with a reaper that kills that session if the launcher dies."""

    def __init__(self, cmd: list[str], **popen):
        self.proc = subprocess.Popen(cmd, start_new_session=True, **popen)
        self._reaper = subprocess.Popen([sys.executable, "-c", _REAPER, str(self.proc.pid)],
                                        stdin=subprocess.PIPE, start_new_session=True)

    def kill_session(self) -> None:
        """SIGKILL the child and everything in its session (a tritonserver's python stubs)."""
        self._reaper.kill()  # first: it must never act on a group id that could be reused
        self._reaper.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the stubs, reaped by init, may take a moment to go
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def replicas(settings: dict[str, str], engine_instances: int | None) -> int | None:
    """Data parallelism: --data-parallel-size N is N ernie_moe instances (Triton's instance_group count), each
    its own stub process with its own engine and KV pool, as vLLM's backend serves replicas. The setting is
    taken out of `settings` (one engine is one replica, so the engine itself refuses it)."""
    raw = settings.pop("data_parallel_size", None) or settings.pop("data-parallel-size", None)
    if raw is None:
        return engine_instances
    n = int(raw)
    if n < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {n}")
    if engine_instances is not None and engine_instances != n:
        raise ValueError(f"--data-parallel-size {n} and --engine-instances {engine_instances} disagree: give one")
    role = settings.get("splitwise_role") or settings.get("splitwise-role")
    if n > 1 and role == "prefill":
        raise ValueError(f"data_parallel_size={n} with splitwise_role=prefill: every replica would listen on the "
                         f"one engine_worker_queue_port; start one prefill server per port instead")
    own = [k for k in ("engine_worker_queue_port", "cache_queue_port")
           if settings.get(k) or settings.get(k.replace("_", "-"))]
    if n > 1 and role == "decode" and own:
        raise ValueError(f"data_parallel_size={n} with splitwise_role=decode and {', '.join(own)}: every replica "
                         f"would listen on the same port; leave them out (each replica then takes its results on its "
                         f"prompt connections) or start one decode server per port")
    return n


PORT_ATTEMPTS = 4  # starts of tritonserver on fresh ports when the ports chosen for it were taken first
SIDE_CHANNEL_SETTINGS = ("engine_worker_queue_port", "cache_queue_port")  # a P/D server's own ports (config.py)


class PortTakenError(OSError):
    """tritonserver could not have a port it was started on: another process listens there."""


class TritonServer:
    """A tritonserver process on a rendered copy of the repository (and the OpenAI shim); a context manager.

    It owns its children: they die with the launcher, however it dies (_Child), and `stop` drains
    before it stops.

    A port given as 0 (Triton's three, the shim's, and the engine_worker_queue_port / cache_queue_port settings of a
    P/D server) is chosen at `start` so that nothing else can answer on it (ports.py): the shim serves on a socket
    bound here and handed over; tritonserver takes a port number only, so the launcher picks the others, starts it,
    starts again on fresh picks when it failed because one was taken (up to PORT_ATTEMPTS), and accepts it only once
    every socket listening on them is the server's own. The attributes then hold the ports in use.
    """

    def __init__(self, settings: dict[str, str] | None = None, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, host: str = "127.0.0.1", repository: Path | None = None,
                 run_dir: Path | None = None, engine_instances: int | None = None,
                 max_inflight_requests: int | None = None, openai_port: int | None = None,
                 exit_timeout: int = 15, drain_timeout: float = 10.0, api_key: str | None = None,
                 admin_api_key: str | None = None, extra_args: tuple[str, ...] = (), log_to_console: bool = False,
                 openai_args: tuple[str, ...] = ()):
        self.settings = {key.replace("-", "_"): value for key, value in (settings or {}).items()}  # one spelling
        engine_instances = replicas(self.settings, engine_instances)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        # what `start` chooses: Triton's ports given as 0, and the P/D servers' own ports (settings) given as 0
        self._chosen = [name for name in ("http_port", "grpc_port", "metrics_port") if getattr(self, name) == 0]
        self._chosen_settings = [key for key in SIDE_CHANNEL_SETTINGS if str(self.settings.get(key)) == "0"]
        self._openai_socket = None  # bound by `start`, handed over to the shim
        self.host = host
        self.repository = Path(repository) if repository else default_repository()
        self._own_run_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="ernie-serve-"))
        self.engine_instances = engine_instances
        self.max_inflight_requests = max_inflight_requests
        self.openai_port = openai_port
        self.exit_timeout = exit_timeout
        self.drain_timeout = drain_timeout
        self.api_key = api_key
        self.admin_api_key = admin_api_key or secrets.token_urlsafe(24)
        self.extra_args = tuple(extra_args)
        self.openai_args = tuple(openai_args)  # more ernie-openai flags (--max-concurrency N, ...)
        self.log_to_console = log_to_console
        self.server_id = f"ernie-serve-{uuid.uuid4().hex[:12]}"
        self._server: _Child | None = None
        self._openai: _Child | None = None
        self.watch: HealthWatch | None = None
        self._install: TritonInstall | None = None
        # FastDeploy's FD_LOG_DIR: the logs go there (and stay after the run dir is cleaned up), named as
        # FastDeploy names its API server's; otherwise the server's log is in the run dir, the shim's on stderr.
        log_dir = fd_log_dir()
        self.log_path = (log_dir or self.run_dir) / "tritonserver.log"
        self.openai_log_path = log_dir / "api_server.log" if log_dir else None
        self.startup_seconds: float | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        """The tritonserver process."""
        return self._server.proc if self._server is not None else None

    @property
    def openai_proc(self) -> subprocess.Popen | None:
        return self._openai.proc if self._openai is not None else None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def ports(self) -> dict[str, int]:
        """The ports by flag; 0 for one `start` chooses and has not yet."""
        named = {"--http-port": self.http_port, "--grpc-port": self.grpc_port, "--metrics-port": self.metrics_port}
        if self.openai_port is not None:
            named["--openai-port"] = self.openai_port
        return named

    def side_channel_ports(self) -> dict[str, int]:
        """A P/D server's own ports (engine_worker_queue_port, cache_queue_port) by setting, where it has them."""
        return {key: int(self.settings[key]) for key in SIDE_CHANNEL_SETTINGS if self.settings.get(key) is not None}

    def command(self, install: TritonInstall, repo: Path, backends: Path | None) -> list[str]:
        cmd = [str(install.binary), "--model-repository", str(repo), "--id", self.server_id,
               "--http-address", self.host, "--http-port", str(self.http_port),
               "--grpc-address", self.host, "--grpc-port", str(self.grpc_port),
               "--metrics-address", self.host, "--metrics-port", str(self.metrics_port),
               "--allow-metrics", "true", "--exit-timeout-secs", str(self.exit_timeout),
               "--strict-readiness", "true", *restricted_api_args(self.admin_api_key, self.api_key)]
        if backends is not None:
            cmd += ["--backend-directory", str(backends)]
            if (self.run_dir / "caches").exists():
                cmd += ["--cache-directory", str(self.run_dir / "caches")]
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 300.0) -> "TritonServer":
        given = {**self.ports(), **{f"--{k.replace('_', '-')}": p for k, p in self.side_channel_ports().items()}}
        taken = [f"{flag} {port}" for flag, port in given.items() if port and port_in_use(self.host, port)]
        if taken:
            raise OSError(f"already in use on {self.host}: {', '.join(taken)} (another server?); "
                          "stop it or choose other ports")
        if self.openai_port is not None and importlib.util.find_spec("ernie_client.openai_server") is not None:
            try:
                self._openai_socket = listening_socket(self.host, self.openai_port)
            except OSError as e:
                raise OSError(f"--openai-port {self.openai_port} on {self.host}: {e.strerror}") from None
            self.openai_port = self._openai_socket.getsockname()[1]
        try:
            self._start_triton(timeout, choose_ports=True)
        except BaseException:
            self._close_openai_socket()
            raise
        if self.openai_port is not None:
            self._start_openai()
        return self

    def _start_triton(self, timeout: float, choose_ports: bool = False) -> None:
        """Start tritonserver and wait until it is ready on ports that are its own. With `choose_ports`, the ports
        given as 0 are picked afresh for each try, and a try that found one taken is followed by another."""
        t0 = time.monotonic()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if choose_ports:
                for name in self._chosen:
                    setattr(self, name, free_port(self.host))
                for key in self._chosen_settings:
                    self.settings[key] = str(free_port(self.host))
            try:
                self._launch_triton(timeout - (time.monotonic() - t0))
                return
            except PortTakenError as e:
                if not (choose_ports and (self._chosen or self._chosen_settings)) or attempt == PORT_ATTEMPTS:
                    raise
                print(f"[ernie-serve] {e}; starting again on other ports", file=sys.stderr, flush=True)

    def _launch_triton(self, timeout: float) -> None:
        t0 = time.monotonic()
        install = self._install = find_tritonserver()
        repo = render_repository(self.repository, self.run_dir / "model_repository", self.settings,
                                 self.engine_instances, self.max_inflight_requests)
        backends = prepare_backends(install, self.run_dir)
        out = None if self.log_to_console else open(self.log_path, "wb")
        # A session of its own: stopping the server reaches the python stubs it forked, and a
        # Ctrl-C in the launcher's terminal reaches the launcher first, which then stops it in order.
        self._server = _Child(self.command(install, repo, backends), env=server_env(install),
                              stdout=out, stderr=subprocess.STDOUT)
        if out is not None:
            out.close()
        try:
            self.wait_ready(timeout - (time.monotonic() - t0))
            self._check_own_ports()
        except RuntimeError as e:
            self.kill()
            if address_in_use(str(e)):
                why = next(line.strip() for line in str(e).splitlines() if address_in_use(line))
                raise PortTakenError(f"tritonserver could not have a port it was given: {why}") from None
            raise
        except BaseException:
            self.kill()
            raise
        self.watch = HealthWatch(self.proc.pid, self.metrics_url)
        self.startup_seconds = time.monotonic() - t0

    def _check_own_ports(self) -> None:
        """Every socket listening on Triton's ports is tritonserver's, and on the P/D ports one of its stubs':
        a port shared with a stranger (SO_REUSEPORT) would send some connections there."""
        owners = {self.http_port: [self.proc.pid], self.grpc_port: [self.proc.pid],
                  self.metrics_port: [self.proc.pid]}
        for port in self.side_channel_ports().values():
            owners[port] = session_pids(self.proc.pid)  # the engine's stub binds them, in the server's session
        strange = [port for port, pids in owners.items() if not listeners_owned_by(port, pids)]
        if strange:
            raise PortTakenError(f"ports {strange} on {self.host} are not (only) this tritonserver's own: "
                                 f"already in use by another process")

    def _close_openai_socket(self) -> None:
        if self._openai_socket is not None:
            self._openai_socket.close()
            self._openai_socket = None

    def _start_openai(self) -> None:
        if self._openai_socket is None:
            print("[ernie-serve] --openai-port given but ernie_client.openai_server is not available; skipped",
                  file=sys.stderr)
            return
        fd = self._openai_socket.fileno()
        cmd = [sys.executable, "-m", "ernie_client.openai_server", "--triton-url", self.grpc_url,
               "--host", self.host, "--port", str(self.openai_port), "--fd", str(fd),
               "--graceful-shutdown-seconds", str(self.drain_timeout + 5), *self._shim_tokenizer_args(),
               "--triton-metrics-url", self.metrics_url, "--engine-control", "auto", *self.openai_args]
        env = server_env(self._install)
        if self.api_key:
            env["ERNIE_OPENAI_API_KEY"] = self.api_key  # not on the command line, where `ps` shows it
        try:
            if self.openai_log_path is None:
                self._openai = _Child(cmd, env=env, pass_fds=(fd,))
                return
            with open(self.openai_log_path, "wb") as out:
                self._openai = _Child(cmd, env=env, pass_fds=(fd,), stdout=out, stderr=subprocess.STDOUT)
        finally:
            # the shim holds the socket now; with it gone, connections are refused rather than left queued here
            self._close_openai_socket()

    def _shim_tokenizer_args(self) -> list[str]:
        """The served model's tokenizer, max_model_len and chat template, for the shim's /tokenize & co."""
        from ..config import EngineConfig
        from .loading import tokenizer_dir

        params = {key: str(value) for key, value in self.settings.items()}
        args = ["--tokenizer", str(tokenizer_dir(params)),
                "--max-model-len", params.get("max_model_len") or str(EngineConfig.max_model_len)]
        return args + (["--chat-template", params["chat_template"]] if params.get("chat_template") else [])

    def _get(self, path: str) -> urllib.request.Request:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return urllib.request.Request(f"http://{self.http_url}{path}", headers=headers)

    def is_ready(self) -> bool:
        """Ready, and it is this launcher's own server answering (not another one on the port)."""
        try:
            with urllib.request.urlopen(self._get("/v2/health/ready"), timeout=2) as r:
                if r.status != 200:
                    return False
            with urllib.request.urlopen(self._get("/v2"), timeout=2) as r:
                return json.loads(r.read()).get("name") == self.server_id
        except (OSError, ValueError):
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + max(timeout, 1.0)
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                why = "".join(f"\n  model '{m}': {reason}" for m, reason in load_failures(self.log_tail(400)))
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail()}" + (f"\nwhy:{why}" if why else ""))
            if self.is_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def health_problem(self) -> str | None:
        """What broke since the server became ready (None: serving). See health.py."""
        return None if self.watch is None else self.watch.problem()

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def drain(self, grace: float) -> None:
        """Refuse new requests, give in-flight ones `grace` seconds, end the rest with an error; return
        once the engines are idle. tritonserver itself cannot: at its exit timeout it cuts the streams
        still open and then crashed or hung (measured, 2.51), and a python model never hears of a stop."""
        engines = self.watch.engine_pids() if self.watch is not None else []
        for pid in engines:
            for address in listener_addresses(pid):
                send_drain(address, grace)
        if self.openai_proc is not None and self.openai_proc.poll() is None:
            self.openai_proc.send_signal(signal.SIGTERM)  # no new connections; open streams go on
        deadline = time.monotonic() + grace + 5
        while engines and time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if requests_in_engines(ernie_samples(self.metrics_url)) == 0:
                    return
            except OSError:
                pass
            time.sleep(0.2)

    def stop(self, timeout: float | None = None) -> int | None:
        """Drain (see `drain`), then SIGTERM: the shim finishes its streams, tritonserver unloads.

        Idle, tritonserver takes a few seconds to stop on a 2-core host (the python stubs' finalize and exit).
        """
        timeout = timeout if timeout is not None else self.exit_timeout + 5
        if self.proc is not None and self.proc.poll() is None:
            self.drain(self.drain_timeout)
        for child in (self._openai, self._server):
            if child is None:
                continue
            if child.proc.poll() is None:
                # Only the server itself: it unloads the models, whose stubs then finalize. A signal to
                # the whole group would kill the stubs first.
                child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            child.kill_session()
        return self.proc.returncode if self.proc is not None else None

    def kill(self) -> None:
        """tritonserver and its stubs, at once (a broken server: its in-flight streams end with an error
        instead of hanging); the shim stays, for a restart."""
        if self._server is not None:
            self._server.kill_session()
        self.watch = None

    def restart(self, timeout: float = 300.0) -> None:
        """A fresh tritonserver on the same ports (the shim reconnects by itself)."""
        self.kill()
        deadline = time.monotonic() + 30
        while any(port_in_use(self.host, p) for p in (self.http_port, self.grpc_port, self.metrics_port)):
            if time.monotonic() > deadline:
                raise OSError("the old tritonserver's ports are still taken")
            time.sleep(0.2)
        self.server_id = f"ernie-serve-{uuid.uuid4().hex[:12]}"
        self._start_triton(timeout)  # on the same ports: the shim reaches Triton on its gRPC port

    def cleanup(self) -> None:
        self._close_openai_socket()
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()

