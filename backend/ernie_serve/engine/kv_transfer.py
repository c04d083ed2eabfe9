"""A sequence's KV cache as a portable object, for prefill/decode disaggregation, and the engine's two ends of it
(KVHandoff: a finished prefill's KV out, a prefilled request in).

The prefill role computes the prompt (and the first token) with `hold_kv=True`, exports the blocks
it filled, and ships them; the decode role imports them into its own pool and continues decoding
as if it had computed them. The bytes take the transport the pair negotiated (engine/kv_transport.py): our
pyzmq frames, or NIXL reading them from the prefill server's registered memory (engine/kv_transport_nixl.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..kv_blocks import KVBlocks
from .step_plan import RequestUpdate

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..outputs import RequestOutput
    from ..sampling_params import SamplingParams
    from .input_processor import InputProcessor
    from .kv_cache_manager import KVCacheManager
    from .output_processor import OutputProcessor
    from .request import Request
    from .scheduler import Scheduler
    from ..step_contract import KVPoolView


class EngineCapacityError(RuntimeError):
    """The KV pool cannot take what was asked right now (e.g. a transferred sequence)."""


@dataclass
class KVTransfer:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens the prefill side already produced (normally the first one)
    num_computed_tokens: int
    block_size: int
    blocks: KVBlocks  # every KV head, in the prefill cache's own format (float32 / bfloat16 / int8 + scales)

    def meta(self) -> dict:
        """Everything but the blocks' bytes (their format included): what every transport sends as it is."""
        return {"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
                "output_token_ids": self.output_token_ids, "num_computed_tokens": self.num_computed_tokens,
                "block_size": self.block_size, "kv": self.blocks.header()}

    @classmethod
    def from_meta(cls, meta: dict, buffers: list) -> "KVTransfer":
        """From meta() and the blocks' raw bytes (pyzmq frames, or arrays a transfer engine filled)."""
        meta = dict(meta)
        return cls(blocks=KVBlocks.from_wire(meta.pop("kv"), buffers), **meta)

    def to_frames(self) -> list:
        return [json.dumps(self.meta()).encode(), *self.blocks.buffers()]

    @classmethod
    def from_frames(cls, frames: list) -> "KVTransfer":
        return cls.from_meta(json.loads(bytes(frames[0])), frames[1:])


def send_kv(socket, transfer: KVTransfer) -> None:
    """Send over a pyzmq socket (multipart: JSON header + raw block data, no pickling)."""
    socket.send_multipart(transfer.to_frames(), copy=False)


def recv_kv(socket) -> KVTransfer:
    return KVTransfer.from_frames(socket.recv_multipart())


class KVHandoff:
    """A request leaving an engine after its prefill (prefill role) or joining one mid-life (decode role). Either
    touches the input processor, the scheduler, the KV manager, the executor's cache and the output processor at
    once; LLMEngine hands them in, and `wait_for_step` (async scheduling) before the cache is read or blocks are
    handed out."""

    def __init__(self, config: "EngineConfig", inputs: "InputProcessor", scheduler: "Scheduler", kv: "KVCacheManager",
                 cache: "KVPoolView", output: "OutputProcessor", wait_for_step: Callable[[], None]):
        self.config, self.inputs, self.scheduler, self.kv = config, inputs, scheduler, kv
        self.cache, self.output, self.wait_for_step = cache, output, wait_for_step

    def export(self, request_id: str) -> KVTransfer:
        """The computed KV of a finished hold_kv request; its blocks are released afterwards."""
        request = self.scheduler.held.get(request_id)
        if request is None:
            raise ValueError(f"request {request_id!r} holds no KV (add it with hold_kv=True and let it finish)")
        self.wait_for_step()  # the cache is read below
        n = self.kv.num_blocks_for(request.num_computed_tokens)
        blocks = self.cache.export_blocks(request.block_ids[:n])
        transfer = KVTransfer(request.request_id, list(request.prompt_token_ids), list(request.output_token_ids),
                              request.num_computed_tokens, self.config.block_size, blocks)
        self.scheduler.release_held(request)
        return transfer

    def admit(self, transfer: KVTransfer, sampling_params: "SamplingParams") -> "tuple[Request, RequestOutput | None]":
        """Continue a request whose prompt KV was computed elsewhere: it joins as running with the transferred
        blocks and tokens. Returns it, and its final output when those tokens already finish it (the first token
        was eos, say); otherwise its outputs come from the engine's steps like any other request's."""
        c, cache = self.config, self.cache
        if transfer.block_size != c.block_size:
            raise ValueError(f"KV transfer block_size {transfer.block_size} != this engine's {c.block_size}")
        want = (cache.num_layers, 2, self.kv.num_blocks_for(transfer.num_computed_tokens), transfer.block_size,
                cache.num_kv_heads, cache.head_dim)
        if transfer.blocks.shape != want:
            raise ValueError(f"KV transfer of shape {list(transfer.blocks.shape)} does not fit this engine's cache "
                             f"(expected {list(want)}): the prefill and decode servers must serve the same model "
                             f"and speculative_config")
        if sampling_params.n != 1:
            raise ValueError("n must be 1 for a prefilled request")
        group = self.inputs.make_group(transfer.request_id, transfer.prompt_token_ids, sampling_params)
        if transfer.request_id in self.output.requests:
            raise ValueError(f"request_id {transfer.request_id!r} is already in use")
        self.wait_for_step()  # blocks are handed out below: none may still be written by a step in flight
        (req,) = group.requests
        if not self.scheduler.add_running(req, transfer.num_computed_tokens):
            raise EngineCapacityError(f"no room for {transfer.blocks.shape[2]} transferred KV blocks "
                                      f"({self.kv.num_free_blocks} free)")
        self.output.add(group)
        cache.import_blocks(req.block_ids, transfer.blocks)
        tokens = transfer.output_token_ids
        new = self.scheduler.append_tokens(req, tokens, [None] * len(tokens))
        out = self.output.process([RequestUpdate(req, new)])
        return req, (out[0] if req.is_finished else None)
