"""The path a prefilled request's KV bytes take from a prefill server to a decode server: one interface, two
transports (kv_protocols.py maps --cache-transfer-protocol onto them).

Both ends keep the control channel they have (serving/disagg.py's pyzmq sockets) and KVTransfer's format
negotiation (KVBlocks: float32 / bfloat16 / int8 codes and their scales); a transport decides only how the blocks'
bytes cross:

    tcp   TcpSender puts them in the KV message itself, as pyzmq frames (zero-copy sends of the exported arrays)
    nixl  NixlSender registers the exported arrays with its NIXL agent and sends only their descriptors;
          NixlReceiver reads them into registered arrays of its own and says so, and the sender lets them go

A sender lives on the prefill server's socket thread, a receiver on the decode server's: neither is shared
between threads.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from .kv_transfer import KVTransfer


@dataclass
class Received:
    """A receive that ended: the transfer, or why it failed; bytes and seconds for the logs and benchmarks."""
    request_id: str
    transfer: KVTransfer | None
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0


class KVSender(Protocol):
    """The prefill side of a transport."""
    name: str

    def hello(self) -> dict:
        """What a decode server needs to receive from this sender (sent in the prefill server's hello answer)."""

    def offer(self, transfer: KVTransfer) -> list:
        """The KV message's frames after its kind: the bytes themselves, or where to read them."""

    def release(self, request_id: str) -> None:
        """The decode server has the bytes (or will never read them): what the offer held can go."""

    def expire(self, now: float) -> list[str]:
        """Let go of offers nobody collected within their time; returns their request ids."""

    @property
    def busy(self) -> bool:
        """Offers are out (the socket thread then calls progress often)."""

    def progress(self) -> None:
        """Move transfers from this side along, where the transport needs the target to."""

    def close(self) -> None: ...


class KVReceiver(Protocol):
    """The decode side of a transport."""
    name: str
    acknowledges: bool  # whether the sender waits for a kv_done after each receive

    def connect(self, hello: dict) -> None:
        """A prefill server's hello answer, before its first KV message."""

    def receive(self, frames: list) -> str:
        """Start receiving a KV message's frames (after its kind); returns the request id."""

    def poll(self) -> list[Received]:
        """The receives that ended since the last poll."""

    @property
    def busy(self) -> bool:
        """Receives are in flight (the socket thread then polls often)."""

    def close(self) -> None: ...


class TcpSender:
    """Our own framing: the blocks' bytes travel in the KV message."""
    name = "tcp"

    def hello(self) -> dict:
        return {}

    def offer(self, transfer: KVTransfer) -> list:
        return transfer.to_frames()

    def release(self, request_id: str) -> None:
        pass

    def expire(self, now: float) -> list[str]:
        return []

    busy = False

    def progress(self) -> None:
        pass

    def close(self) -> None:
        pass


class TcpReceiver:
    """The frames are the bytes: a receive ends as it starts."""
    name = "tcp"
    acknowledges = False

    def __init__(self):
        self._done: list[Received] = []

    def connect(self, hello: dict) -> None:
        pass

    def receive(self, frames: list) -> str:
        t0 = time.perf_counter()
        transfer = KVTransfer.from_frames(frames)
        self._done.append(Received(transfer.request_id, transfer, None, transfer.blocks.nbytes,
                                   time.perf_counter() - t0))
        return transfer.request_id

    def poll(self) -> list[Received]:
        done, self._done = self._done, []
        return done

    @property
    def busy(self) -> bool:
        return False

    def close(self) -> None:
        pass


def make_sender(name: str, label: str) -> KVSender:
    """A sender of the named transport; label names this server in the engine's logs (its queue port)."""
    if name == "nixl":
        from .kv_transport_nixl import NixlSender
        return NixlSender(label)
    return TcpSender()


def make_receiver(name: str, label: str) -> KVReceiver:
    if name == "nixl":
        from .kv_transport_nixl import NixlReceiver
        return NixlReceiver(label)
    return TcpReceiver()


def negotiate(offered: list[str], accepted: list[str]) -> str | None:
    """The sender's first transport that the receiver takes (None: they share none)."""
    return next((name for name in offered if name in accepted), None)
