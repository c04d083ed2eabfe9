"""The abort channel from the detokenizer back to the engine instance that runs a request.

Why it exists: Triton (2.51) does not pass an ensemble's cancellation to a step that is already
running; it marks only the step requests it creates afterwards (measured: the decoupled ernie_moe
request never sees is_cancelled(), every later ernie_detokenizer request does). So the detokenizer,
on its first cancelled request, sends the request key to the engine instance named in the request's
metadata, and that instance aborts it, freeing its KV blocks.

One Linux abstract-namespace datagram socket per engine instance: no files to clean up, no port.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Callable

log = logging.getLogger(__name__)
_MAX_DATAGRAM = 4096


class AbortListener:
    """Receives request keys to abort and hands them to `on_abort` on its own thread."""

    def __init__(self, on_abort: Callable[[str], None], tag: str = "ernie-moe"):
        self.address = f"\0{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.address)
        self._sock.settimeout(0.5)
        self._on_abort = on_abort
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ernie-abort-listener", daemon=True)
        self._thread.start()

    @property
    def public_address(self) -> str:
        """The address as it can travel in JSON (the leading NUL marks the abstract namespace)."""
        return "@" + self.address[1:]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(_MAX_DATAGRAM)
            except socket.timeout:
                continue
            except OSError:
                return
            key = data.decode("utf-8", "replace")
            try:
                self._on_abort(key)
            except Exception:  # noqa: BLE001 - one bad abort must not stop the listener
                log.exception("abort of %s failed", key)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


def send_abort(address: str, key: str) -> bool:
    """Ask the engine instance at `address` to abort request `key`; False if it is gone."""
    if not address:
        return False
    raw = "\0" + address[1:] if address.startswith("@") else address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(key.encode("utf-8"), raw)
            return True
        except OSError as e:
            log.warning("could not send abort for %s to %s: %s", key, address, e)
            return False
