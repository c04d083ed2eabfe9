"""`ernie-openai`: the OpenAI-compatible server in front of a Triton serving the `ernie` ensemble.

    ernie-openai --triton-url localhost:8001 --port 9000 [--host 127.0.0.1] [--model-name ernie]
                 [--served-model-name NAME] [--api-key KEY] [--max-concurrency N] [--max-waiting-time S]
                 [--request-timeout S] [--tokenizer DIR [--max-model-len N] [--chat-template T]]
                 [--graceful-shutdown-seconds S] [--timeout-keep-alive S] [--triton-metrics-url URL]
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

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
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
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
                        triton_metrics_url=args.triton_metrics_url)


def uvicorn_config(args: argparse.Namespace, app):
    """uvicorn's Config for the shim's flags: the one place its server settings come from."""
    import uvicorn

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          timeout_graceful_shutdown=args.graceful_shutdown_seconds,
                          timeout_keep_alive=args.timeout_keep_alive)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the first SIGTERM drains: /health 503 and new requests refused while running ones finish (openai/replica.py)
    server = draining_server(uvicorn_config(args, create_app(config_from_args(args))))
    try:
        server.run(sockets=None if args.fd is None else [socket.socket(fileno=args.fd)])
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(3)  # uvicorn.run's status for a server that never started


if __name__ == "__main__":
    main()
