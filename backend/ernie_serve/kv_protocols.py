"""FastDeploy's --cache-transfer-protocol mapped onto the KV transports a prefill/decode pair has, and the one place
that imports NIXL (the transfer engine behind the rdma / ipc protocols).

    tcp   our own framing: KVTransfer's frames over the pyzmq sockets (engine/kv_transport.py); needs nothing more
    rdma  NIXL, UCX backend: RDMA (InfiniBand / RoCE) between hosts with the NICs (engine/kv_transport_nixl.py)
    ipc   NIXL, UCX backend: cross-memory attach (one kernel copy) between processes of one host
    nixl  NIXL, named directly

One NIXL agent serves both rdma and ipc: UCX picks the transport per peer (shared memory on one host, the fabric
across hosts), so "rdma", "ipc" and "rdma,ipc" all select it. A list is the order of preference; the prefill server
picks the first transport of its own list that the decode server also takes (docs/kv-transfer.md).
"""
from __future__ import annotations

import importlib

FLAG = "cache_transfer_protocol (--cache-transfer-protocol)"
TRANSPORTS = {"tcp": "tcp", "rdma": "nixl", "ipc": "nixl", "nixl": "nixl"}
DEFAULT = "tcp"
# The NIXL builds' Python APIs, each imported directly (nixl_cu12 runs on a host without a GPU, and the KV buffers are
# host memory, which either build moves); the `nixl` meta package last: it refuses outright when the CUDA it detects
# (an nvcc, say) has no build installed, and may import torch to find out.
NIXL_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")
_nixl = None


def transports(protocol: str | None) -> list[str]:
    """The transports a --cache-transfer-protocol value selects, in its order, each once."""
    tokens = [t.strip().lower() for t in (protocol or DEFAULT).split(",") if t.strip()]
    unknown = [t for t in tokens if t not in TRANSPORTS]
    if unknown or not tokens:
        raise ValueError(f"{FLAG} has {', '.join(map(repr, unknown)) or 'no protocol'}; known: "
                         f"{', '.join(TRANSPORTS)} (comma-separated, in order of preference)")
    out: list[str] = []
    for t in tokens:
        if TRANSPORTS[t] not in out:
            out.append(TRANSPORTS[t])
    return out


def nixl_api():
    """NIXL's Python API module (nixl_agent, nixl_agent_config), from whichever build imports here; a clear error
    naming the flag and the install when none does."""
    global _nixl
    if _nixl is not None:
        return _nixl
    failures = []
    for name in NIXL_MODULES:
        try:
            _nixl = importlib.import_module(name)
            return _nixl
        except Exception as e:  # noqa: BLE001 - ImportError, or the meta package refusing its CUDA pick
            failures.append(f"{name}: {type(e).__name__}: {e}")
    raise ValueError(f"{FLAG} selects NIXL (rdma / ipc / nixl) but no NIXL build imports here ("
                     f"{'; '.join(failures)}); install it (pip install nixl-cu12, or scripts/setup.sh), or use "
                     f"--cache-transfer-protocol tcp")


def check(protocol: str | None) -> list[str]:
    """The transports, refused at start-up when one cannot run here."""
    names = transports(protocol)
    if "nixl" in names:
        nixl_api()
    return names
