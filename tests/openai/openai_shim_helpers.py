"""Helpers shared by the shim tests: free ports and the shim under a real uvicorn in a thread."""
from __future__ import annotations

import threading
import time


from ernie_serve.serving.launcher import free_port  # noqa: E402  (ports outside the ephemeral range)


class RunningShim:
    """uvicorn serving `app` on 127.0.0.1:<free port> until stop()."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the shim did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
