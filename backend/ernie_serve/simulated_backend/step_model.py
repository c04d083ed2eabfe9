"""The roofline model of one engine step on the target (DESIGN.md, "What a GPU would ask of the host"), and the size
of the target's KV pool. Per GPU under tensor parallelism: weights, KV heads and FLOPs split evenly across ranks.

A step's time is max(memory, compute) + the fixed per-step cost (+ two all-reduces a layer with TP) + KV swaps:
- memory: the weights it touches (attention, dense FFNs, shared experts, routers and the lm_head always; of the
  routed experts those its tokens hit: E * (1 - (1 - k/E)^T) a layer for T tokens routed uniformly) plus the KV it
  reads (every sequence's whole context) and writes (its new tokens), over HBM bandwidth x memory_efficiency;
- compute: 2 x active parameters x tokens (the lm_head only for the rows that take logits) over the dense bf16
  FLOP/s x compute_efficiency: what bounds a prefill. Attention's score FLOPs are left out (a few percent at 2k);
- swaps: KV blocks moved between host and GPU over the host link.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .targets import Target


@dataclass(frozen=True)
class StepCost:
    seconds: float  # the modeled step, before the time scale
    memory_seconds: float
    compute_seconds: float
    weight_bytes: float  # per GPU
    kv_bytes: float  # per GPU, read and written
    experts_hit: float  # per MoE layer


def experts_hit(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts of a layer that num_tokens tokens, each routed to top_k of num_experts uniformly,
    touch: each expert is missed by one token with probability 1 - k/E."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


class StepModel:
    def __init__(self, target: Target):
        self.target = target
        m, c, wb = target.model, target.constants, target.weight_bytes
        self.tp = target.tensor_parallel_size
        self.always_bytes = (m.num_layers * m.attention_params * wb + m.num_dense_layers * m.dense_ffn_params * wb
                             + m.num_moe_layers * (m.shared_expert_params * wb + m.gate_params * c.router_bytes)
                             + m.embedding_params * c.float_weight_bytes)  # the lm_head, read whole every step
        self.expert_bytes = m.expert_params * wb
        self.kv_token_bytes = m.kv_bytes_per_token(c.kv_dtype_bytes)
        self.lm_head_params = m.embedding_params
        self.body_params = m.active_params - self.lm_head_params  # per token, without the lm_head
        self.bandwidth = target.gpu.hbm_bandwidth * c.memory_efficiency
        self.flops = target.gpu.bf16_flops * c.compute_efficiency
        self.overhead = c.fixed_step_seconds + (2 * m.num_layers * c.allreduce_seconds if self.tp > 1 else 0.0)

    def cost(self, num_tokens: int, num_logit_rows: int, seq_lens: np.ndarray) -> StepCost:
        """A step computing num_tokens tokens of sequences with these context lengths (this step's tokens
        included), num_logit_rows of them through the lm_head."""
        m = self.target.model
        hit = experts_hit(m.config.moe_num_experts, m.config.moe_k, num_tokens) if num_tokens else 0.0
        weights = (self.always_bytes + m.num_moe_layers * hit * self.expert_bytes) / self.tp
        kv = (int(seq_lens.sum()) + num_tokens) * self.kv_token_bytes / self.tp
        memory = (weights + kv) / self.bandwidth
        compute = 2.0 * (self.body_params * num_tokens + self.lm_head_params * num_logit_rows) / self.tp / self.flops
        return StepCost(max(memory, compute) + self.overhead, memory, compute, weights, kv, hit)

    def swap_seconds(self, num_blocks: int, block_size: int) -> float:
        """Moving num_blocks KV blocks between host and GPU (each rank its share, at once)."""
        t = self.target
        bytes_moved = num_blocks * block_size * self.kv_token_bytes / self.tp
        return bytes_moved / (t.gpu.host_link_bandwidth * t.constants.host_link_efficiency)


def total_weight_bytes(target: Target) -> float:
    """Every weight held per GPU: the quantized linears, routers, embedding and (untied) lm_head."""
    m, c, wb = target.model, target.constants, target.weight_bytes
    linear = (m.num_layers * m.attention_params + m.num_dense_layers * m.dense_ffn_params
              + m.num_moe_layers * (m.config.moe_num_experts * m.expert_params + m.shared_expert_params))
    floats = m.embedding_params * (1 if m.config.tie_word_embeddings else 2)
    total = linear * wb + m.num_moe_layers * m.gate_params * c.router_bytes + floats * c.float_weight_bytes
    return total / target.tensor_parallel_size


def activation_bytes(target: Target, max_num_seqs: int, max_num_batched_tokens: int) -> float:
    """What a GPU keeps out of its KV pool beside the weights: a fixed reserve, a step's [tokens, hidden] buffers
    and its fp32 logits."""
    m, c = target.model, target.constants
    return (c.activation_reserve_bytes + max_num_batched_tokens * m.config.hidden_size * 2 * c.activation_copies
            + max_num_seqs * m.config.vocab_size * 4)


def kv_pool_blocks(target: Target, gpu_memory_utilization: float, block_size: int, max_num_seqs: int,
                   max_num_batched_tokens: int) -> int:
    """Blocks of the target's KV pool, sized as a GPU engine sizes it: gpu_memory_utilization x HBM, less the
    weights and the activations, over one block's bytes (per GPU)."""
    free = (gpu_memory_utilization * target.gpu.hbm_bytes - total_weight_bytes(target)
            - activation_bytes(target, max_num_seqs, max_num_batched_tokens))
    block = block_size * target.model.kv_bytes_per_token(target.constants.kv_dtype_bytes) / target.tensor_parallel_size
    return max(0, int(free // block))
