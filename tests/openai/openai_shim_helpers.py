"""Helpers shared by the shim tests: the shim under a real uvicorn in a thread, on a socket bound before it starts
(ports.py: nothing else can take the port in between)."""
from __future__ import annotations

import threading
import time

from ernie_serve.ports import listening_socket, refusing_socket  # noqa: F401  (the shim tests take them from here)


class RunningShim:
    """uvicorn serving `app` on 127.0.0.1:<a port of its own> until stop()."""

    def __init__(self, app, shim_flags: list[str] | None = None):
        """`shim_flags`: serve with uvicorn configured as `ernie-openai` with these flags configures it
        (openai_server.uvicorn_config), instead of uvicorn's own defaults."""
        import uvicorn

        from ernie_client.openai_server import parse_args, uvicorn_config

        sock = listening_socket()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        if shim_flags is None:
            config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        else:
            config = uvicorn_config(parse_args([*shim_flags, "--port", str(self.port), "--log-level", "warning"]), app)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                sock.close()
                raise RuntimeError("the shim did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
