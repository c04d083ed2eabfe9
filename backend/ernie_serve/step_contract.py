"""The step contract: the types that cross between the engine's core (scheduler, model runner, sampler) and the
executors that run a step (the reference backend: reference_backend/shard.py and its tensor-parallel workers; the
kernels backend: kernels_backend/). Neutral on purpose: it imports neither side, so an executor depends on this
module and not on the engine, and the engine picks an executor without the two importing each other.

- StepInput: one engine step as plain index data (no Request), with its wire form for tensor-parallel workers.
- KVOp / apply_kv_ops: the block moves (swap out, swap in, copy) the KV manager records and an executor carries out
  before the step's forward.
- StepExecutor: what the model runner drives.
- DeviceLogits (and the LogitEdits / TopLogprobs it takes and gives): logits left on the device that computed
  them, sampled there; the host sampler (engine/sampler.py) is the reference for every method.

StepInput holds no Request: token ids, positions, the attention metadata's index arrays, the KV swaps/copies to
apply first and which rows to compute logits for, so it crosses a process boundary as a JSON header plus raw
array bytes (no pickling). Tensor-parallel workers are not sent it whole: the driver sends what changed since the
last step (tensor_parallel/persistent_batch.py) and each worker rebuilds this same StepInput from its own copy of the
block tables. `row_keys` names each row's request for that; the shards never read it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .kv_blocks import KVBlocks
from .model.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class KVOp:
    kind: str  # "swap_out" (device -> host), "swap_in" (host -> device), "copy" (device -> device)
    src: int
    dst: int


def apply_kv_ops(ops: list[KVOp], cache, host_cache) -> None:
    """Carry out recorded block moves, in order, on a cache with whole-block read_blocks / write_blocks (either
    backend's) and the CPU tier's host array [num_host_blocks, layers, 2, block_size, kv_heads, head_dim]."""
    for op in ops:
        if op.kind == "swap_out":
            host_cache[op.dst] = cache.read_blocks([op.src])[:, :, 0]
        elif op.kind == "swap_in":
            cache.write_blocks([op.dst], host_cache[op.src][:, :, None])
        else:
            cache.write_blocks([op.dst], cache.read_blocks([op.src]))


_EMPTY = np.zeros(0, dtype=np.int64)
_ARRAYS = ("token_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping", "sample_rows",
           "row_keys")
# Sequences computing at most this many tokens share the batched attention path: they are the step's first
# num_decodes rows. Defined here, next to num_decodes, so the driver and the workers that rebuild a step
# (persistent_batch.py) count decodes by one rule.
MAX_BATCHED_QUERY = 8


@dataclass
class StepInput:
    token_ids: np.ndarray = field(default_factory=lambda: _EMPTY)  # [T] int64, the step's tokens flattened
    positions: np.ndarray = field(default_factory=lambda: _EMPTY)  # [T] int64
    query_start_loc: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B+1] int64 (AttentionMetadata's)
    seq_lens: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B] int64
    block_tables: np.ndarray = field(default_factory=lambda: _EMPTY.reshape(0, 0))  # [B, nb] int64
    slot_mapping: np.ndarray = field(default_factory=lambda: _EMPTY)  # [T] int64
    sample_rows: np.ndarray = field(default_factory=lambda: _EMPTY)  # [R] rows whose logits are computed
    num_decodes: int = 0
    max_position: int = 0
    kv_ops: list[KVOp] = field(default_factory=list)  # applied before the forward, in this order
    row_keys: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B] int64 each row's Request.row_key
    # Every sampled row takes its argmax and nothing else (the runner's ArgmaxRows): an executor may then hand back
    # ArgmaxLogits instead of the logits. Not sent to tensor-parallel workers, which return logits.
    argmax_only: bool = False

    @classmethod
    def for_tokens(cls, token_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata,
                   sample_rows: np.ndarray, kv_ops: list[KVOp], row_keys: np.ndarray = _EMPTY,
                   argmax_only: bool = False) -> "StepInput":
        return cls(token_ids, positions, meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping,
                   sample_rows, meta.num_decodes, meta.max_position, kv_ops, row_keys, argmax_only)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def attention_metadata(self, block_size: int) -> AttentionMetadata:
        return AttentionMetadata(self.query_start_loc, self.seq_lens, self.block_tables, self.slot_mapping,
                                 self.num_decodes, block_size, self.max_position)

    def to_frames(self) -> list[bytes | np.ndarray]:
        return pack_frames({"num_decodes": self.num_decodes, "max_position": self.max_position,
                            "kv_ops": kv_ops_to_json(self.kv_ops)},
                           [getattr(self, name) for name in _ARRAYS])

    @classmethod
    def from_frames(cls, frames: list) -> "StepInput":
        header, arrays = unpack_frames(frames)
        return cls(**dict(zip(_ARRAYS, arrays)), num_decodes=header["num_decodes"],
                   max_position=header["max_position"], kv_ops=kv_ops_from_json(header["kv_ops"]))


def pack_frames(header: dict, arrays: list[np.ndarray]) -> list[bytes | np.ndarray]:
    """A JSON header (the arrays' shapes added to it), then each array's raw int64 bytes: no pickling."""
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in arrays]
    header = dict(header, shapes=[list(a.shape) for a in arrays])
    return [json.dumps(header).encode()] + [a.reshape(-1).view(np.uint8) for a in arrays]


def unpack_frames(frames: list) -> tuple[dict, list[np.ndarray]]:
    """pack_frames' header and arrays; the arrays are read-only views of the frames."""
    header = json.loads(bytes(frames[0]))
    return header, [np.frombuffer(frame, dtype=np.int64).reshape(shape)
                    for frame, shape in zip(frames[1:], header["shapes"])]


def kv_ops_to_json(ops: list[KVOp]) -> list[list]:
    return [[op.kind, op.src, op.dst] for op in ops]


def kv_ops_from_json(ops: list[list]) -> list[KVOp]:
    return [KVOp(kind, src, dst) for kind, src, dst in ops]


class KVPoolView(Protocol):
    """The engine's view of an executor's KV pool: its shape with all the model's KV heads (across the ranks under
    tensor parallelism), and whole blocks in and out (the prefill / decode hand-off's format). Each backend's cache
    is one (model/kv_cache.PagedKVCache, kernels_backend/kv_cache.py), and tensor_parallel/workers.AllRanksKV."""

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def export_blocks(self, block_ids: list[int]) -> KVBlocks: ...
    def import_blocks(self, block_ids: list[int], blocks: KVBlocks) -> None: ...


class DraftHead(Protocol):
    """An executor's MTP head over its own KV cache (engine/mtp_drafter.py drives it; reference_backend/shard.py,
    kernels_backend/shard.py and tensor_parallel/workers.py provide one)."""

    block_size: int

    def take(self, hidden: Any, rows: np.ndarray) -> Any:
        """hidden[rows], on the executor's device."""

    def run(self, step: StepInput, hidden: Any) -> Any:
        """The head's output hidden states for step.token_ids (x_{t+1}) and hidden (h_t) at step.positions (t),
        writing the head's K/V at step.slot_mapping."""

    def logits(self, hidden: Any) -> "np.ndarray | DeviceLogits":
        """float32 logits [R, vocab] of hidden states the head produced: on the host, or left on the device
        (DeviceLogits: drafts are then drawn there, and sampling requests' q stays there)."""


# What an executor returns for a step's logits rows: host logits (NumPy, or a CPU tensor the sampler reads through
# DLPack), logits left on the device, an argmax-only step's ArgmaxLogits, or None when the step computes none.
StepLogits = Any


class StepExecutor(Protocol):
    """Runs a StepInput on the whole model: reference_backend/shard.ModelShard (one rank),
    tensor_parallel/workers.TensorParallelExecutor (every rank) or kernels_backend/shard.KernelShard.
    execute returns (the step's final hidden states, on the executor's device, and the logits of
    step.sample_rows as StepLogits)."""

    cache: KVPoolView
    draft_head: DraftHead | None

    def execute(self, step: StepInput) -> tuple[Any, StepLogits]: ...


@dataclass
class LogitEdits:
    """The logit bias, penalties and token masks of a batch as per-(row, token) edits, so the host and a device
    apply the same ones to whichever copy of the logits they hold: v' = -inf where masked, else
    (w / rep if w > 0 else w * rep) - sub with w = v + bias.

    vLLM's semantics and order: the request's logit_bias, then the repetition penalty rep over prompt + output
    tokens (1 where it does not apply), then sub = frequency * count + presence over output tokens, then the
    bad-words and min_tokens masks."""
    rows: np.ndarray  # [N] int64, each (row, token) once
    tokens: np.ndarray  # [N] int64
    bias: np.ndarray  # [N] float32
    repetition: np.ndarray  # [N] float32
    subtract: np.ndarray  # [N] float32
    masked: np.ndarray  # [N] bool

    def apply(self, logits: np.ndarray) -> None:
        """In place on host logits [R, V]."""
        v = logits[self.rows, self.tokens] + self.bias
        v = np.where(v > 0, v / self.repetition, v * self.repetition) - self.subtract
        logits[self.rows, self.tokens] = np.where(self.masked, -np.inf, v)


# rows of logits a logprob reduction takes at once, on the host or a device: bounds its [rows, vocab] temporaries
# (log-softmax, ranks, top-k) for a long prompt's logits
LOGPROB_ROWS_AT_ONCE = 256


@dataclass
class TopLogprobs:
    """The logprob figures of the rows that asked for them, from the raw (unpenalized) log-softmax; small enough to
    cross from a device."""
    sampled: np.ndarray  # [R'] logprob of each row's sampled token
    sampled_rank: np.ndarray  # [R'] 1 + the number of tokens strictly more likely
    top_ids: np.ndarray  # [R', n] the n most likely tokens, most likely first
    top: np.ndarray  # [R', n] their logprobs


@dataclass
class ArgmaxLogits:
    """What an argmax-only step (StepInput.argmax_only) needs of its logits, reduced where they were computed: each
    row's argmax (the first index of its largest logit; a NaN counts as the largest) and largest logit. The
    reference backend's lm_head computes these without storing the logits (cpu_gemm.gemm_argmax)."""
    token_ids: np.ndarray  # [R] int64
    row_max: np.ndarray  # [R] float32

    def argmax(self) -> tuple[np.ndarray, np.ndarray]:
        return self.token_ids, self.row_max


class DeviceLogits:
    """The sampled rows' logits left on the device that computed them (the kernels backend returns these), with
    what the sampler asks of them there, so that only token ids (and asked-for logprobs) cross to the host. Row
    max values come back too: a row whose largest logit is not finite (all -inf, or a NaN) has no token left, as on
    the host."""

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def numpy(self) -> np.ndarray:
        """The logits [R, vocab] as float32 on the host."""
        raise NotImplementedError

    def take(self, rows: np.ndarray) -> "DeviceLogits":
        """These rows, as they came (before any edit), as DeviceLogits of their own: a step's sampled rows apart
        from the rows it computed for prompt logprobs."""
        raise NotImplementedError

    def edit(self, edits: "LogitEdits") -> None:
        """Apply the batch's penalties and masks in place, as LogitEdits.apply does on the host."""
        raise NotImplementedError

    def argmax(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's argmax (first index of its largest logit) and largest logit."""
        raise NotImplementedError

    def add_rows(self, rows: np.ndarray, bias: np.ndarray) -> None:
        """logits[rows] += bias (host [len(rows), vocab] float32: the grammar masks), in place."""
        raise NotImplementedError

    def top_logprobs(self, rows: np.ndarray, token_ids: np.ndarray, n: int) -> "TopLogprobs":
        """TopLogprobs of the given rows from the logits as they were before any edit."""
        raise NotImplementedError

    def sample(self, greedy: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               min_p: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of Sampler's "base" method (see the module doc) from the uniforms u, one a row (ignored on greedy
        rows, which take the argmax), with the filters as row_filters gives them, and each row's largest logit."""
        raise NotImplementedError

    def sample_rejection(self, greedy: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                         min_p: np.ndarray, uniforms: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of Sampler's "rejection" method (_sample_rejection): each round draws, for the rows still
        rejecting, one uniform each from uniforms(rows); greedy rows take the argmax. And each row's largest logit."""
        raise NotImplementedError

    def draft(self, rows: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
              min_p: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, list[Any]]:
        """A draft model's tokens for `rows` (raw logits, no edits): each drawn in token order at uniform u from q,
        the row's temperature / top-k / top-p / min-p distribution (sampling_distribution, then draw), and each
        row's q as a [1, V] row left on the device, for verify to take back a step later."""
        raise NotImplementedError

    def verify(self, rows: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               min_p: np.ndarray, draft_tokens: np.ndarray, draft_probs: list[Any], u_accept: np.ndarray,
               u_residual: np.ndarray) -> np.ndarray:
        """verify_sampled_drafts' rule on `rows` of these (edited) logits: keep draft d where
        u_accept * q(d) < p(d), else draw from max(0, p - q) at u_residual. q: draft's rows (or host arrays)."""
        raise NotImplementedError
