"""A sequence's KV cache as a portable object, for prefill/decode disaggregation.

The prefill role computes the prompt (and the first token) with `hold_kv=True`, exports the blocks
it filled, and ships them; the decode role imports them into its own pool and continues decoding
as if it had computed them. On one host the payload goes over ZMQ (pyzmq); across hosts the same
object is what an RDMA transport would move.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..kv_blocks import KVBlocks


@dataclass
class KVTransfer:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens the prefill side already produced (normally the first one)
    num_computed_tokens: int
    block_size: int
    blocks: KVBlocks  # every KV head, in the prefill cache's own format (float32 / bfloat16 / int8 + scales)

    def to_frames(self) -> list:
        meta = {"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
                "output_token_ids": self.output_token_ids, "num_computed_tokens": self.num_computed_tokens,
                "block_size": self.block_size, "kv": self.blocks.header()}
        return [json.dumps(meta).encode(), *self.blocks.buffers()]

    @classmethod
    def from_frames(cls, frames: list) -> "KVTransfer":
        meta = json.loads(bytes(frames[0]))
        return cls(blocks=KVBlocks.from_wire(meta.pop("kv"), frames[1:]), **meta)


def send_kv(socket, transfer: KVTransfer) -> None:
    """Send over a pyzmq socket (multipart: JSON header + raw block data, no pickling)."""
    socket.send_multipart(transfer.to_frames(), copy=False)


def recv_kv(socket) -> KVTransfer:
    return KVTransfer.from_frames(socket.recv_multipart())
