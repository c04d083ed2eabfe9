"""The shim's keep-alive timeout outlives client pools' idle expiry, so a pooled connection is never closed under a
request the client has just sent on it (the soak's lost requests: httpx ReadError, no response byte)."""
from __future__ import annotations

import socket
import time

from ernie_client.openai import ServerConfig, create_app
from ernie_client.openai_server import parse_args, uvicorn_config

from openai_shim_helpers import RunningShim

HTTPX_KEEPALIVE_EXPIRY = 5.0  # httpx.Limits' default keepalive_expiry: the shortest common client pool's
LOAD_BALANCER_IDLE = 60.0  # a cloud load balancer's default idle timeout (AWS ALB's)


def test_the_shim_keeps_idle_connections_open_longer_than_client_pools_and_load_balancers():
    config = uvicorn_config(parse_args([]), app=None)
    assert config.timeout_keep_alive > LOAD_BALANCER_IDLE
    assert uvicorn_config(parse_args(["--timeout-keep-alive", "7.5"]), app=None).timeout_keep_alive == 7.5


def test_a_non_positive_keep_alive_is_refused(capsys):
    try:
        parse_args(["--timeout-keep-alive", "0"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--timeout-keep-alive 0 was accepted")
    assert "--timeout-keep-alive must be > 0 seconds, got 0.0" in capsys.readouterr().err


def _get_models(sock: socket.socket) -> bytes:
    """One GET /v1/models on an open connection: the response's head and body, or b'' when the server closed it."""
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: shim\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_connection_idle_longer_than_httpx_pools_keep_it_is_still_served():
    """httpx reuses a pooled connection idle up to 5 s; with uvicorn's own 5 s the shim closed it at about the same
    moment, and under load a request sent just before was lost. Idle past that, the same connection still serves."""
    shim = RunningShim(create_app(ServerConfig(triton_url="127.0.0.1:1")), shim_flags=[])
    try:
        with socket.create_connection(("127.0.0.1", shim.port), timeout=30) as sock:
            assert _get_models(sock).startswith(b"HTTP/1.1 200")
            time.sleep(HTTPX_KEEPALIVE_EXPIRY + 1.5)
            again = _get_models(sock)
            assert again.startswith(b"HTTP/1.1 200"), f"the idle connection was closed: {again!r}"
            assert b'"object":"list"' in again
    finally:
        shim.stop()
