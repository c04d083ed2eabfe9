"""The KV hand-off on NIXL (NVIDIA's transfer engine, what vLLM's NixlConnector and Dynamo move KV with), UCX backend.

The decode side pulls, as vLLM's connector does: the prefill server registers the arrays it exported (no copy) and
sends their addresses and its agent's metadata for them over the control channel; the decode server registers
arrays of its own, posts one READ for all of them, polls it to the end, and tells the prefill server (kv_done),
which then deregisters and drops its arrays. An offer nobody collects is let go after HOLD_SECONDS.

UCX picks the wire per peer: shared memory or TCP on one host, RDMA verbs where a fabric joins the hosts, so the
same code is FastDeploy's ipc and rdma. Agents exchange their metadata in the hello of the control channel (no
NIXL listener thread, no metadata server).
"""
from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np

from ..kv_protocols import nixl_api
from .kv_transfer import KVTransfer
from .kv_transport import Received

log = logging.getLogger(__name__)
HOLD_SECONDS = 120.0  # an offer's arrays stay registered this long at most, waiting for the decode side's read
READ_SECONDS = 60.0  # a read still in flight after this is abandoned (its request fails), so none waits forever
BACKEND = "UCX"


def _agent(role: str, label: str):
    """An agent without NIXL's progress thread, which polls without pause (a fifth of a core idle): the socket
    thread that owns the agent drives its progress instead, often while a transfer is in flight (busy)."""
    api = nixl_api()
    return api.nixl_agent(f"ernie-{role}-{label}-{uuid.uuid4().hex[:8]}",
                          api.nixl_agent_config(enable_prog_thread=False, backends=[BACKEND]))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class _Offer:
    registration: object
    arrays: list[np.ndarray]
    since: float


class NixlSender:
    """The prefill side: registered exports, waiting to be read."""
    name = "nixl"

    def __init__(self, label: str):
        self.agent = _agent("prefill", label)
        self._offers: dict[str, _Offer] = {}

    def hello(self) -> dict:
        return {"agent": self.agent.name, "metadata": _b64(self.agent.get_agent_metadata())}

    def offer(self, transfer: KVTransfer) -> list:
        arrays = transfer.blocks.arrays()
        registration = self.agent.register_memory([(a.ctypes.data, a.nbytes, 0, "") for a in arrays], "DRAM")
        self.release(transfer.request_id)  # a request id offered again replaces its old offer
        self._offers[transfer.request_id] = _Offer(registration, arrays, time.monotonic())
        # the new regions' keys, and how to connect: the KV message may overtake the hello's answer (own ports)
        metadata = self.agent.get_partial_agent_metadata(registration, True)
        return [json.dumps({"transfer": transfer.meta(), "agent": self.agent.name, "metadata": _b64(metadata),
                            "buffers": [[a.ctypes.data, a.nbytes] for a in arrays]}).encode()]

    def release(self, request_id: str) -> None:
        offer = self._offers.pop(request_id, None)
        if offer is not None:
            self.agent.deregister_memory(offer.registration)

    def expire(self, now: float) -> list[str]:
        old = [rid for rid, offer in self._offers.items() if now - offer.since > HOLD_SECONDS]
        for rid in old:
            log.warning("NIXL: the KV of request %s was not read by its decode server within %.0f s; letting it go",
                        rid, HOLD_SECONDS)
            self.release(rid)
        return old

    @property
    def busy(self) -> bool:
        return bool(self._offers)

    def progress(self) -> None:
        """Let the backend progress (a read over UCX's TCP transport needs its target's worker to): asking for
        notifications does."""
        if self._offers:
            self.agent.get_new_notifs()

    @property
    def held_bytes(self) -> int:
        """Bytes registered and waiting to be read (readable from another thread: a snapshot of the offers)."""
        return sum(a.nbytes for offer in tuple(self._offers.values()) for a in offer.arrays)

    def close(self) -> None:
        for rid in list(self._offers):
            self.release(rid)


@dataclass
class _Read:
    request_id: str
    meta: dict
    arrays: list[np.ndarray]
    registration: object
    handle: object
    peer: str
    started: float
    state: str = "PROC"
    nbytes: int = 0


class NixlReceiver:
    """The decode side: READs into registered arrays of its own, polled to the end."""
    name = "nixl"
    acknowledges = True

    def __init__(self, label: str):
        self.agent = _agent("decode", label)
        self._reads: list[_Read] = []
        self._failed: list[Received] = []

    def connect(self, hello: dict) -> None:
        self.agent.add_remote_agent(base64.b64decode(hello["metadata"]))

    def receive(self, frames: list) -> str:
        msg = json.loads(bytes(frames[0]))
        rid = msg["transfer"]["request_id"]
        started = time.perf_counter()
        try:
            self.agent.add_remote_agent(base64.b64decode(msg["metadata"]))
            arrays = [np.empty(n, np.uint8) for _, n in msg["buffers"]]
            registration = self.agent.register_memory([(a.ctypes.data, a.nbytes, 0, "") for a in arrays], "DRAM")
            local = self.agent.get_xfer_descs([(a.ctypes.data, a.nbytes, 0) for a in arrays], "DRAM")
            remote = self.agent.get_xfer_descs([(addr, n, 0) for addr, n in msg["buffers"]], "DRAM")
            handle = self.agent.initialize_xfer("READ", local, remote, msg["agent"])
            read = _Read(rid, msg["transfer"], arrays, registration, handle, msg["agent"], started,
                         nbytes=sum(a.nbytes for a in arrays))
            read.state = self.agent.transfer(handle)
        except Exception as e:  # noqa: BLE001 - the request fails with why; the server serves on
            self._failed.append(Received(rid, None, f"NIXL read of its KV from {msg.get('agent')} failed: "
                                                    f"{type(e).__name__}: {e}"))
            return rid
        self._reads.append(read)
        return rid

    def poll(self) -> list[Received]:
        done, self._failed = self._failed, []
        still = []
        now = time.perf_counter()
        for read in self._reads:
            if read.state == "PROC":
                read.state = self.agent.check_xfer_state(read.handle)
            if read.state == "PROC" and now - read.started > READ_SECONDS:
                read.state = f"no completion after {READ_SECONDS:.0f} s"
            if read.state == "PROC":
                still.append(read)
                continue
            done.append(self._finish(read))
        self._reads = still
        return done

    def _finish(self, read: _Read) -> Received:
        try:
            read.handle.release()  # a read still in flight is aborted (and NIXL raises)
        except Exception as e:  # noqa: BLE001 - it failed already; why is said below
            read.state += f" ({type(e).__name__}: {e})"
        self.agent.deregister_memory(read.registration)
        seconds = time.perf_counter() - read.started
        if read.state != "DONE":
            return Received(read.request_id, None, f"NIXL read of its KV from {read.peer} ended in {read.state}",
                            read.nbytes, seconds)
        try:
            transfer = KVTransfer.from_meta(read.meta, read.arrays)
        except ValueError as e:
            return Received(read.request_id, None, f"the KV read from {read.peer}: {e}", read.nbytes, seconds)
        return Received(read.request_id, transfer, None, read.nbytes, seconds)

    @property
    def busy(self) -> bool:
        return bool(self._reads)

    def close(self) -> None:
        for read in self._reads:
            read.state = "closed"
            self._finish(read)
        self._reads = []
