"""ernie-serve / scripts/serve.sh: FastDeploy-named flags -> a rendered model repository -> tritonserver.

    ernie-serve                                   # the embedded tiny model on 8000/8001/8002
    ernie-serve --model /ckpt/ERNIE-4.5-21B-A3B-Paddle --max-model-len 8192 --max-num-seqs 32 \
                --reasoning-parser ernie-x1 --tool-call-parser ernie-x1 --openai-port 9000
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import fields

from ..config import EngineConfig

# Flags that belong to the launcher, not to the engine.
SERVER_FLAGS = {"http_port", "grpc_port", "metrics_port", "openai_port", "port", "host", "max_inflight_requests",
                "engine_instances", "run_dir", "startup_timeout", "state_ttl_seconds", "log_to_console",
                "restart_on_failure", "drain_timeout", "api_key", "admin_api_key", "max_concurrency",
                "max_waiting_time", "workers"}
# The launcher's flags that go on to the OpenAI shim's command line (ernie-openai), under the same names.
OPENAI_FLAGS = ("max_concurrency", "max_waiting_time", "workers")
HEALTH_CHECK_SECONDS = 0.5


def api_key_from_env() -> str | None:
    """--api-key's default: ERNIE_API_KEY, else FastDeploy's FD_API_KEY (so a FastDeploy deployment's environment
    keeps its key). FastDeploy takes several comma-separated keys there; one key is served here, so a list is
    refused rather than taken as one long key."""
    for name in ("ERNIE_API_KEY", "FD_API_KEY"):
        key = os.environ.get(name, "").strip()
        if key:
            if "," in key:
                raise ValueError(f"{name} holds several comma-separated keys; ernie-serve takes one API key")
            return key
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ernie-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--http-port", type=int, default=None,
                   help="Triton's HTTP port (default 8000; with --port: a free port; 0: a free port; a free port "
                        "is printed at start-up)")
    g.add_argument("--grpc-port", type=int, default=None,
                   help="Triton's gRPC port (default 8001; with --port or 0: a free port, printed at start-up)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="Triton's metrics port, ernie:* (default 8002; with --port or 0: a free port)")
    g.add_argument("--openai-port", type=int, default=None,
                   help="also start the OpenAI shim on this port (0: a free port, printed at start-up)")
    g.add_argument("--port", type=int, default=None,
                   help="FastDeploy's API server port: the OpenAI shim's, as --openai-port (then Triton's own "
                        "ports default to free ones, so two servers started as FastDeploy's are do not collide)")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a container)")
    g.add_argument("--max-concurrency", default=None,
                   help="the OpenAI shim's generation requests at once (default 512); more are refused with 429, "
                        "or wait with --max-waiting-time")
    g.add_argument("--max-waiting-time", default=None,
                   help="seconds a shim request over --max-concurrency waits for a slot before a 408 (-1: no limit)")
    g.add_argument("--workers", default=None,
                   help="the OpenAI shim's worker processes on its one port (default 1), as FastDeploy's API "
                        "server; --max-concurrency is split among them (each admits "
                        "ceil(--max-concurrency / --workers))")
    g.add_argument("--max-inflight-requests", type=int, default=None,
                   help="ensemble max_inflight_requests (needs a tritonserver newer than 2.51)")
    g.add_argument("--engine-instances", type=int, default=None,
                   help="ernie_moe instances (one engine each); --data-parallel-size N is the same with N")
    g.add_argument("--state-ttl-seconds", default=None, help="detokenizer per-request state TTL")
    g.add_argument("--run-dir", default=None, help="where the rendered repository and the log go")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    g.add_argument("--log-to-console", action="store_true", help="tritonserver log to this terminal")
    g.add_argument("--restart-on-failure", action="store_true",
                   help="restart tritonserver when its engine or a python stub dies (default: exit 1)")
    g.add_argument("--drain-timeout", type=float, default=10.0,
                   help="on Ctrl-C / SIGTERM, seconds in-flight requests get to finish before they end "
                        "with an error (new ones are refused at once)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the shim's /v1 and on Triton's inference, "
                        "metadata, config and statistics APIs (gRPC: 'triton-grpc-protocol-authorization' "
                        "metadata); health stays open (env ERNIE_API_KEY, else FastDeploy's FD_API_KEY)")
    g.add_argument("--admin-api-key", default=os.environ.get("ERNIE_ADMIN_API_KEY"),
                   help="value of the 'admin-key' header that Triton's shared-memory, model-repository, logging "
                        "and trace APIs require (default: a random key, i.e. those APIs are off; env "
                        "ERNIE_ADMIN_API_KEY)")
    e = p.add_argument_group("engine (FastDeploy flag names; rendered into config.pbtxt parameters)")
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if "bool" in str(f.type):
            e.add_argument(flag, dest=f.name, nargs="?", const="true", default=None, metavar="BOOL")
        else:
            e.add_argument(flag, dest=f.name, default=None)
    return p


def settings_from_args(args: argparse.Namespace) -> dict[str, str]:
    out = {k: str(v) for k, v in vars(args).items()
           if k not in SERVER_FLAGS and v is not None}
    if args.state_ttl_seconds is not None:
        out["state_ttl_seconds"] = str(args.state_ttl_seconds)
    # Fail here, with the flag's name, rather than inside a model's initialize. data_parallel_size is
    # the launcher's (replicas as Triton instances), not one engine's.
    from ..engine.executor_factory import check_supported
    from ..serving.launcher import SIDE_CHANNEL_SETTINGS
    from ..serving.pb import engine_config_from_parameters

    engine = {k: v for k, v in out.items() if k not in ("state_ttl_seconds", "data_parallel_size")}
    # a P/D server's own port given as 0 is the launcher's to choose at start-up (TritonServer): checked as a port
    # that differs from the others (the engine itself only ever sees the chosen one)
    engine.update({k: str(65535 - i) for i, k in enumerate(SIDE_CHANNEL_SETTINGS) if engine.get(k) == "0"})
    check_supported(engine_config_from_parameters(engine))
    return out


def resolve_model_arg(args: argparse.Namespace) -> None:
    """--model as FastDeploy takes it (model_source.py): a model id becomes its local directory here, before
    tritonserver starts, so the rendered repository names a directory and a failure is one message (exit 2)
    rather than one per model that loads the checkpoint."""
    from ..model_source import resolve_model

    if args.model is not None and args.model.strip():
        local = resolve_model(args.model)
        if local != args.model:
            print(f"[ernie-serve] --model {args.model}: {local}", flush=True)
        args.model = local


def resolve_ports(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--port is FastDeploy's API server port, i.e. the shim's. A FastDeploy-style launch names only its own
    ports (--port, --metrics-port), so Triton's HTTP and gRPC ports it leaves out are free ones rather than
    8000/8001, which a second server on the host would collide on; a plain launch keeps Triton's defaults. A free
    port is a 0 here: the launcher chooses it at start-up, where nothing can take it before the server does."""
    if args.port is not None and args.openai_port is not None and args.port != args.openai_port:
        parser.error(f"--port {args.port} and --openai-port {args.openai_port}: both are the OpenAI API's port; "
                     "give one")
    fastdeploy_style = args.port is not None
    args.openai_port = args.openai_port if args.openai_port is not None else args.port
    for name, default in (("http_port", 8000), ("grpc_port", 8001), ("metrics_port", 8002)):
        port = getattr(args, name)
        if port is None:
            port = 0 if fastdeploy_style else default
        if not 0 <= port < 65536:
            parser.error(f"--{name.replace('_', '-')} {port} is not a TCP port")
        setattr(args, name, port)
    if args.openai_port is not None and not 0 <= args.openai_port < 65536:
        parser.error(f"--{'port' if fastdeploy_style else 'openai-port'} {args.openai_port} is not a TCP port")
    given = [("--http-port", args.http_port), ("--grpc-port", args.grpc_port), ("--metrics-port", args.metrics_port)]
    if args.openai_port is not None:
        given.append(("--port" if fastdeploy_style else "--openai-port", args.openai_port))
    ports = [port for _, port in given if port]  # 0s are chosen apart at start-up
    if len(set(ports)) != len(ports):
        parser.error("two of " + ", ".join(f"{flag} {port}" for flag, port in given) + " are the same port")


def openai_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, ...]:
    """The shim's flags given to the launcher, checked now by the shim's own parser (not after tritonserver
    has loaded); refused without --openai-port, where nothing would read them."""
    flags = [f"--{name.replace('_', '-')}" for name in OPENAI_FLAGS if getattr(args, name) is not None]
    if not flags:
        return ()
    if args.openai_port is None:
        parser.error(f"{', '.join(flags)}: only the OpenAI shim reads this; give --openai-port too")
    given = tuple(a for flag in flags for a in (flag, str(getattr(args, flag[2:].replace('-', '_')))))
    from ernie_client.openai_server import parse_args as shim_args

    shim_args(["--port", str(args.openai_port), *given])
    return given


def server_from_args(argv: list[str] | None = None):
    """The TritonServer an ernie-serve command line describes, not started; flag errors exit as argparse's do
    (2, naming the flag), engine setting errors raise ValueError."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.drain_timeout < 0:
        parser.error(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.api_key is None:
        args.api_key = api_key_from_env()
    resolve_model_arg(args)
    resolve_ports(parser, args)
    openai_args = openai_flags(parser, args)
    settings = settings_from_args(args)
    from ..serving.launcher import TritonServer

    server = TritonServer(settings, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, host=args.host, run_dir=args.run_dir,
                          engine_instances=args.engine_instances, max_inflight_requests=args.max_inflight_requests,
                          openai_port=args.openai_port, log_to_console=args.log_to_console,
                          drain_timeout=args.drain_timeout, api_key=args.api_key,
                          admin_api_key=args.admin_api_key, openai_args=openai_args)
    return server, args


def main(argv: list[str] | None = None) -> int:
    try:
        server, args = server_from_args(argv)
    except (ValueError, TypeError) as e:
        print(f"ernie-serve: {e}", file=sys.stderr)
        return 2
    stopping = []

    def on_signal(signum, _frame):
        stopping.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"[ernie-serve] starting tritonserver (run dir {server.run_dir}) ...", flush=True)
    try:
        server.start(timeout=args.startup_timeout)
    except Exception as e:  # noqa: BLE001
        print(f"[ernie-serve] failed to start: {e}", file=sys.stderr)
        return 1
    if "paddle" in sys.modules:  # Paddle's failure-signal handler replaced ours at its import: SIGTERM would abort
        signal.signal(signal.SIGINT, on_signal)  # the process instead of draining (this process needs no Paddle;
        signal.signal(signal.SIGTERM, on_signal)  # tests/serving/test_serving_units.py checks it imports none)
    print(ready_banner(server), flush=True)
    code = supervise(server, stopping, args.restart_on_failure, args.startup_timeout)
    if stopping:
        print("[ernie-serve] stopping: in-flight requests finish or are cancelled, then the server exits",
              flush=True)
    t0 = time.monotonic()
    server.stop()
    print(f"[ernie-serve] stopped in {time.monotonic() - t0:.1f}s", flush=True)
    if code == 0:
        server.cleanup()
    return code


def ready_banner(server) -> str:
    """What a started server prints: where each of its endpoints is (a port given as 0 shows the one chosen)."""
    return (f"[ernie-serve] ready in {server.startup_seconds:.1f}s\n"
            f"  HTTP     http://{server.http_url}  (POST /v2/models/ernie/generate, /generate_stream)\n"
            f"  gRPC     {server.grpc_url}  (model 'ernie', or 'ernie_bls')\n"
            f"  metrics  {server.metrics_url}  (ernie:*)\n"
            + (f"  OpenAI   http://{server.host}:{server.openai_port}/v1\n" if server.openai_proc else "")
            + f"  log      {server.log_path}\n"
            + (f"  shim log {server.openai_log_path}\n" if server.openai_proc and server.openai_log_path else "")
            + "  Ctrl-C to stop.")


_BANNER_PORTS = {"http": r"^  HTTP +http://[^ ]*:(\d+)", "grpc": r"^  gRPC +[^ ]*:(\d+)",
                 "metrics": r"^  metrics +http://[^ ]*:(\d+)/", "openai": r"^  OpenAI +http://[^ ]*:(\d+)/"}


def banner_ports(output: str) -> dict[str, int]:
    """The ports in the last ready banner of `output` (http, grpc, metrics, and openai when the shim runs): how a
    caller that started `ernie-serve` with ports of 0 learns the ones it got."""
    import re

    last = output[output.rindex("] ready in"):] if "] ready in" in output else ""
    found = {name: re.search(pattern, last, re.M) for name, pattern in _BANNER_PORTS.items()}
    return {name: int(m.group(1)) for name, m in found.items() if m}


def supervise(server, stopping: list, restart: bool, startup_timeout: float) -> int:
    """Watch the server until a stop signal (0) or a failure it may not survive: exit code 1, or a
    restart with --restart-on-failure. A broken server is killed at once, so that its in-flight
    streams end with an error instead of hanging and readiness stops answering."""
    restarts = 0
    while not stopping:
        problem = server.health_problem()
        if problem is None:
            time.sleep(HEALTH_CHECK_SECONDS)
            continue
        print(f"[ernie-serve] tritonserver failed: {problem}\n{server.log_tail(20)}", file=sys.stderr, flush=True)
        if not restart:
            server.kill()
            return 1
        restarts += 1
        print(f"[ernie-serve] restarting tritonserver (restart {restarts}) ...", file=sys.stderr, flush=True)
        try:
            server.restart(timeout=startup_timeout)
        except Exception as e:  # noqa: BLE001
            print(f"[ernie-serve] restart failed: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"[ernie-serve] ready again in {server.startup_seconds:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
