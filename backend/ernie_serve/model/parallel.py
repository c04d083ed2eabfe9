"""Tensor and expert parallelism: which slice of each weight a rank holds, and the collectives that put
the partial results back together.

Megatron-style tensor parallelism over N ranks, every rank running the same step on the same tokens:
- attention: query heads split evenly; KV heads split too, or, when there are fewer KV heads than ranks,
  replicated so that each rank keeps the one KV head its query heads read. qkv_proj is column-parallel
  (each rank's Q, K and V columns), o_proj row-parallel (the rows of its heads), so o_proj's output is
  a partial sum;
- MLP and experts: the intermediate dimension is split (up_gate column-parallel with each rank's gate
  and up columns, down row-parallel): partial sums again. With expert parallelism the routed experts
  are split whole instead (rank r owns experts [r*E/N, (r+1)*E/N)); hidden states are replicated on
  every rank after each all-reduce, so every rank already has every token and routes them itself
  (the router is replicated), computes its own experts' share, and the MoE block's all-reduce is the
  combine;
- one all-reduce after attention and one after the MLP / MoE block (shared and routed experts' partial
  sums are added first, so they share it);
- vocab-parallel embedding (each rank embeds the ids in its vocab range, zeros elsewhere, all-reduce)
  and lm_head (each rank's vocab columns; the sampled rows' logits are all-gathered).

The layout itself is framework free (the kernels backend slices its weights with it, on a torch-only box too).
The reference model's collectives here are paddle.distributed's, on a process group of this engine's own
(process_groups.py); the kernels backend's are kernels_backend/collectives.py. With world_size 1 every
collective is the identity, so the single-rank model is unchanged.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..kv_blocks import KVBlocks
from .config import ErnieModelConfig

if TYPE_CHECKING:
    import paddle


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place among the tensor-parallel ranks of one engine, and their process group."""

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False
    group: Any = None  # paddle.distributed Group; None when world_size is 1

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------ what this rank holds
    def split(self, n: int) -> range:
        """This rank's part of n things split evenly (check() has made sure N divides n)."""
        size = n // self.world_size
        return range(self.rank * size, (self.rank + 1) * size)

    def query_heads(self, cfg: ErnieModelConfig) -> range:
        return self.split(cfg.num_attention_heads)

    def kv_heads(self, cfg: ErnieModelConfig) -> range:
        """The KV heads this rank's query heads read: its share, or the one it replicates."""
        kv, n = cfg.num_key_value_heads, self.world_size
        if kv >= n:
            return self.split(kv)
        group = cfg.num_attention_heads // kv  # query heads per KV head
        first = self.query_heads(cfg).start // group
        return range(first, first + 1)

    def experts(self, cfg: ErnieModelConfig) -> range:
        return self.split(cfg.moe_num_experts) if self.expert_parallel else range(cfg.moe_num_experts)

    def expert_intermediate(self, cfg: ErnieModelConfig) -> int:
        """Each routed expert's intermediate size on this rank (whole under expert parallelism)."""
        return cfg.moe_intermediate_size if self.expert_parallel else cfg.moe_intermediate_size // self.world_size

    def check(self, cfg: ErnieModelConfig) -> None:
        """Refuse a layout the model cannot be split into, naming the numbers."""
        n = self.world_size
        if n == 1:
            return
        need = [("num_attention_heads", cfg.num_attention_heads), ("vocab_size", cfg.vocab_size)]
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
            need.append(("intermediate_size", cfg.intermediate_size))
        if cfg.is_moe:
            need.append(("moe_num_experts", cfg.moe_num_experts) if self.expert_parallel
                        else ("moe_intermediate_size", cfg.moe_intermediate_size))
            if cfg.moe_num_shared_experts:
                need.append(("moe_intermediate_size * moe_num_shared_experts",
                             cfg.moe_intermediate_size * cfg.moe_num_shared_experts))
        for name, value in need:
            if value % n:
                raise ValueError(f"tensor_parallel_size={n} does not divide the model's {name}={value}: "
                                 f"choose a tensor_parallel_size that does")
        kv = cfg.num_key_value_heads
        if kv >= n and kv % n:
            raise ValueError(f"tensor_parallel_size={n} does not divide num_key_value_heads={kv}")
        if kv < n and n % kv:
            raise ValueError(f"num_key_value_heads={kv} is fewer than tensor_parallel_size={n} and does not "
                             f"divide it, so KV heads cannot be replicated evenly across ranks")

    # ------------------------------------------------------------ whole KV blocks (prefill/decode transfer)
    def gather_kv_blocks(self, local: KVBlocks, all_gather: Callable[[np.ndarray], list[np.ndarray]],
                         cfg: ErnieModelConfig) -> KVBlocks:
        """Whole blocks with every KV head of the model from each rank's export of its own (a collective every rank
        joins with the same blocks); `all_gather`: the ranks' host arrays, in rank order, by the caller's collectives."""
        if not self.is_parallel:
            return local
        codes = all_gather(local.codes)
        scales = all_gather(local.scales) if local.scales is not None else [None] * self.world_size
        heads = [ParallelLayout(r, self.world_size, self.expert_parallel).kv_heads(cfg) for r in range(self.world_size)]
        parts = [KVBlocks(c, local.scale_kind, sc) for c, sc in zip(codes, scales)]
        return KVBlocks.join_heads(parts, heads, cfg.num_key_value_heads)

    def own_kv_blocks(self, blocks: KVBlocks, cfg: ErnieModelConfig) -> KVBlocks:
        """The KV heads this rank holds of whole blocks."""
        return blocks.take_heads(self.kv_heads(cfg)) if self.is_parallel else blocks

    # ------------------------------------------------------------ collectives
    def all_reduce(self, x: "paddle.Tensor") -> "paddle.Tensor":
        """Sum of the ranks' partial results (in place); the identity on one rank."""
        if self.world_size == 1:
            return x
        import paddle

        paddle.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: "paddle.Tensor") -> "paddle.Tensor":
        """The ranks' column blocks side by side, in rank order; the identity on one rank."""
        if self.world_size == 1:
            return x
        import paddle

        parts: list[paddle.Tensor] = []
        paddle.distributed.all_gather(parts, x, group=self.group)
        return paddle.concat(parts, axis=-1)

    # ------------------------------------------------------------ checkpoint slicing
    def shard_of(self, param: str, cfg: ErnieModelConfig) -> tuple[int, np.ndarray] | None:
        """For a parameter of the full model (loader name, Paddle [in, out] layout): the axis this rank
        slices and the full-tensor indices it keeps along it, in local order; None: replicated."""
        if self.world_size == 1:
            return None
        if param == "embed_tokens.weight":
            return 0, _indices(self.split(cfg.vocab_size))
        if param == "lm_head.weight":
            return 1, _indices(self.split(cfg.vocab_size))
        if param.startswith("block."):  # the MTP head's decoder layer (model/mtp.py) splits as a layer does
            param = f"layers.{cfg.num_hidden_layers}.{param[len('block.'):]}"
        m = _LAYER_PARAM.match(param)
        if m is None:
            return None
        rest = m.group(2)
        hd = cfg.head_dim
        if rest == "self_attn.qkv_proj.weight":
            q, kv = cfg.q_size, cfg.kv_size
            heads, kv_heads = self.query_heads(cfg), self.kv_heads(cfg)
            cols = [_head_cols(heads, hd), q + _head_cols(kv_heads, hd), q + kv + _head_cols(kv_heads, hd)]
            return 1, np.concatenate(cols)
        if rest == "self_attn.o_proj.weight":
            return 0, _head_cols(self.query_heads(cfg), hd)
        if rest in ("mlp.up_gate_proj.weight", "mlp.down_proj.weight"):
            return _mlp_shard(rest, self.split(cfg.intermediate_size), cfg.intermediate_size, 0)
        if rest in ("mlp.shared_experts.up_gate_proj.weight", "mlp.shared_experts.down_proj.weight"):
            inter = cfg.moe_intermediate_size * cfg.moe_num_shared_experts
            return _mlp_shard(rest, self.split(inter), inter, 0)
        if rest in ("mlp.experts.up_gate_proj", "mlp.experts.down_proj"):
            if self.expert_parallel:
                return 0, _indices(self.split(cfg.moe_num_experts))
            inter = cfg.moe_intermediate_size
            return _mlp_shard(rest, self.split(inter), inter, 1)  # after the expert axis
        return None


SINGLE_RANK = ParallelLayout()
_LAYER_PARAM = re.compile(r"^layers\.(\d+)\.(.+)$")


def _indices(r: range) -> np.ndarray:
    return np.arange(r.start, r.stop, dtype=np.int64)


def _head_cols(heads: range, head_dim: int) -> np.ndarray:
    return _indices(range(heads.start * head_dim, heads.stop * head_dim))


def _mlp_shard(name: str, part: range, inter: int, lead: int) -> tuple[int, np.ndarray]:
    """up_gate ([.., H, 2I], gate half first): this rank's gate columns then its up columns; down ([.., I, H]):
    its rows. `lead`: axes before the [in, out] pair (1 for stacked experts)."""
    if name.endswith("up_gate_proj.weight") or name.endswith("up_gate_proj"):
        return lead + 1, np.concatenate([_indices(part), inter + _indices(part)])
    return lead, _indices(part)
