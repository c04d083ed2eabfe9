"""Models made by HF transformers itself (tests/model/test_hf_parity.py, the kernels backend's tensor-parallel
test): an implementation from outside this project, with its own tensor names, as the oracle."""
from __future__ import annotations

import numpy as np
import torch
import transformers

VOCAB = 4096  # the demo tokenizer's size, so no logits are masked on either side
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=4096)
MOE = dict(BASE, moe_num_experts=6, moe_k=2, moe_intermediate_size=32)
CONFIGS = {
    "moe_tied_shared": dict(MOE, tie_word_embeddings=True, moe_num_shared_experts=1, moe_layer_start_index=1,
                            moe_layer_end_index=2),
    "moe_untied_noshared_interval2": dict(MOE, tie_word_embeddings=False, moe_num_shared_experts=0,
                                          moe_layer_start_index=0, moe_layer_end_index=2, moe_layer_interval=2),
    "moe_headdim_ne_hidden_over_heads": dict(MOE, tie_word_embeddings=True, head_dim=24, moe_num_shared_experts=2,
                                             moe_layer_start_index=2, moe_layer_end_index=2),
    "dense_tied_headdim": dict(BASE, tie_word_embeddings=True, head_dim=32),
    "dense_untied": dict(BASE, tie_word_embeddings=False),
    # one KV head: what each rank of ERNIE-4.5-300B holds at tensor-parallel 8
    "moe_one_kv_head": dict(MOE, num_key_value_heads=1, tie_word_embeddings=True, moe_num_shared_experts=1,
                            moe_layer_start_index=1, moe_layer_end_index=2),
    "dense_one_kv_head_headdim": dict(BASE, num_key_value_heads=1, tie_word_embeddings=False, head_dim=24),
    # sizes that are no multiple of a SIMD width or a tile, so the C kernels run their tails (the expert width
    # stays a multiple of 4: transformers' grouped matmul needs 16-byte strides)
    "moe_odd_sizes": dict(MOE, hidden_size=68, num_attention_heads=3, num_key_value_heads=1, head_dim=20,
                          intermediate_size=50, moe_intermediate_size=20, moe_num_experts=5, moe_k=3,
                          moe_num_shared_experts=1, tie_word_embeddings=False, moe_layer_start_index=1,
                          moe_layer_end_index=2),
}


def hf_model(name: str):
    """A transformers Ernie4_5(_Moe)ForCausalLM of config `name`, randomly initialized (the same weights each call)."""
    cfg = dict(CONFIGS[name])
    if "moe_num_experts" in cfg:
        config, cls = transformers.Ernie4_5_MoeConfig(**cfg), transformers.Ernie4_5_MoeForCausalLM
    else:
        config, cls = transformers.Ernie4_5Config(**cfg), transformers.Ernie4_5ForCausalLM
    torch.manual_seed(sorted(CONFIGS).index(name))
    model = cls(config).eval()
    with torch.no_grad():  # larger than HF's 0.02 init, so logits are well separated and greedy is stable
        for pname, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 1.0 / np.sqrt(p.shape[-1]))
            elif "norm" in pname:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.05)
    return model
