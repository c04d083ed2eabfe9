"""A sequence's KV cache as a portable object, for prefill/decode disaggregation.

The prefill role computes the prompt (and the first token) with `hold_kv=True`, exports the blocks
it filled, and ships them; the decode role imports them into its own pool and continues decoding
as if it had computed them. On one host the payload goes over ZMQ (pyzmq); across hosts the same
object is what an RDMA transport would move.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


@dataclass
class KVTransfer:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens the prefill side already produced (normally the first one)
    num_computed_tokens: int
    block_size: int
    data: np.ndarray  # [layers, 2, num_blocks, block_size, kv_heads, head_dim], float32

    def to_frames(self) -> list[bytes]:
        meta = {"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
                "output_token_ids": self.output_token_ids, "num_computed_tokens": self.num_computed_tokens,
                "block_size": self.block_size, "shape": list(self.data.shape), "dtype": str(self.data.dtype)}
        return [json.dumps(meta).encode(), np.ascontiguousarray(self.data).tobytes()]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> "KVTransfer":
        meta = json.loads(frames[0])
        data = np.frombuffer(frames[1], dtype=meta.pop("dtype")).reshape(meta.pop("shape"))
        return cls(data=data, **meta)


def send_kv(socket, transfer: KVTransfer) -> None:
    """Send over a pyzmq socket (multipart: JSON header + raw block data, no pickling)."""
    socket.send_multipart(transfer.to_frames(), copy=False)


def recv_kv(socket) -> KVTransfer:
    return KVTransfer.from_frames(socket.recv_multipart())
