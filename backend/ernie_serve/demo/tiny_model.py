"""The embedded demo checkpoints: built locally, deterministically, with no download.

`tiny` is the default model of every entry point (tests, `scripts/serve.sh`, the Triton repo). Its
random init is fitted (demo/fit.py) to the chat set in demo/data/chat_demo.jsonl, so that greedy
decoding of those prompts answers in ERNIE-4.5 Thinking's format: reasoning, `</think>`, then a
`<response>` or `<tool_call>` block; its MTP head is then fitted on the same set with the body frozen,
so MTP speculative decoding on the demo has drafts worth accepting. `build_checkpoint` alone writes random weights: `bench`, the
benchmark-size model (8 layers, hidden 1024, 16 experts top-4), stays random.
The tiny model's head is untied: with a tied head and random layers the residual stream stays close
to the input embedding, so greedy decoding would just repeat the last token.
"""
from __future__ import annotations

import copy
import fcntl
import json
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..model.checkpoint_writer import pt_to_paddle, write_checkpoint
from ..model.config import ErnieModelConfig
from ..paths import tiny_model_dir
from .tokenizer_builder import build_tokenizer

log = logging.getLogger(__name__)
BUILD_VERSION = 4  # bump when the recipe changes, so stale local builds are rebuilt
RANDOM_INIT_VERSION = 2  # bump when random_weights changes (benchmark checkpoints are rebuilt)

_BASE = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096, "use_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": True,
    "moe_layer_interval": 1, "moe_norm_min": 1e-12, "dtype": "float32",
}
CONFIGS = {
    "tiny": dict(_BASE, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_num_experts=8, moe_k=2,
                 moe_intermediate_size=96, moe_num_shared_experts=1, moe_layer_start_index=1,
                 moe_layer_end_index=3, tie_word_embeddings=False),
    "bench": dict(_BASE, vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128, moe_num_experts=16, moe_k=4,
                  moe_intermediate_size=704, moe_num_shared_experts=1, moe_layer_start_index=0,
                  moe_layer_end_index=7, max_position_embeddings=8192),
}


def _initializers(rng: np.random.Generator):
    """lin(out, in): a torch-layout linear at unit gain; norm(n): an RMSNorm weight near 1."""
    def lin(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp), dtype=np.float32) / np.sqrt(inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    return lin, norm


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """"-PT" tensors for `config`, drawn from a fixed seed (same bytes on every machine)."""
    cfg = ErnieModelConfig.from_dict(config)
    rng = np.random.default_rng(seed)
    h, hd = cfg.hidden_size, cfg.head_dim
    lin, norm = _initializers(rng)

    embed = rng.standard_normal((cfg.vocab_size, h), dtype=np.float32)
    if cfg.tie_word_embeddings:
        # With a tied head, unit-scale embeddings make h . e_x ~ |e_x|^2 = H dominate every other logit,
        # and greedy decoding repeats the last token; at 1/sqrt(H) the layers decide the next token.
        embed /= np.sqrt(h)
    t = {"model.embed_tokens.weight": embed, "model.norm.weight": norm(h)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = 4.0 * lin(cfg.vocab_size, h)  # peaked, varied next-token choices
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "self_attn.q_proj.weight"] = lin(cfg.q_size, h)
        t[p + "self_attn.k_proj.weight"] = lin(cfg.kv_size, h)
        t[p + "self_attn.v_proj.weight"] = lin(cfg.kv_size, h)
        t[p + "self_attn.o_proj.weight"] = lin(h, cfg.q_size)
        if cfg.is_moe_layer(i):
            inter = cfg.moe_intermediate_size
            t[p + "mlp.gate.weight"] = lin(cfg.moe_num_experts, h)
            t[p + "mlp.moe_statics.e_score_correction_bias"] = (
                0.01 * rng.standard_normal((1, cfg.moe_num_experts), dtype=np.float32))
            for e in range(cfg.moe_num_experts):
                q = f"{p}mlp.experts.{e}."
                t[q + "gate_proj.weight"], t[q + "up_proj.weight"] = lin(inter, h), lin(inter, h)
                t[q + "down_proj.weight"] = lin(h, inter)
            if cfg.moe_num_shared_experts:
                s = inter * cfg.moe_num_shared_experts
                q = p + "mlp.shared_experts."
                t[q + "gate_proj.weight"], t[q + "up_proj.weight"] = lin(s, h), lin(s, h)
                t[q + "down_proj.weight"] = lin(h, s)
        else:
            q = p + "mlp."
            t[q + "gate_proj.weight"] = lin(cfg.intermediate_size, h)
            t[q + "up_proj.weight"] = lin(cfg.intermediate_size, h)
            t[q + "down_proj.weight"] = lin(h, cfg.intermediate_size)
    return t


def random_mtp_weights(config: dict, seed: int = 1) -> dict[str, np.ndarray]:
    """"-PT" tensors of an MTP head (model.mtp_*: two norms, the 2H -> H projection, one dense decoder layer)."""
    cfg = ErnieModelConfig.from_dict(config)
    lin, norm = _initializers(np.random.default_rng(seed))
    h, inter = cfg.hidden_size, cfg.intermediate_size
    b = "model.mtp_block.0."
    return {
        "model.mtp_emb_norm.0.weight": norm(h), "model.mtp_hidden_norm.0.weight": norm(h),
        "model.mtp_linear_proj.0.weight": lin(h, 2 * h),
        b + "input_layernorm.weight": norm(h), b + "post_attention_layernorm.weight": norm(h),
        b + "self_attn.q_proj.weight": lin(cfg.q_size, h), b + "self_attn.k_proj.weight": lin(cfg.kv_size, h),
        b + "self_attn.v_proj.weight": lin(cfg.kv_size, h), b + "self_attn.o_proj.weight": lin(h, cfg.q_size),
        b + "mlp.gate_proj.weight": lin(inter, h), b + "mlp.up_proj.weight": lin(inter, h),
        b + "mlp.down_proj.weight": lin(h, inter),
    }


def build_checkpoint(out_dir: Path, name: str = "tiny", layout: str = "pt", seed: int = 0,
                     weights: dict[str, np.ndarray] | None = None) -> Path:
    """Write config, weights (layout "pt" or "paddle"; random unless given) and the demo tokenizer."""
    if layout not in ("pt", "paddle"):
        raise ValueError(f"layout must be 'pt' or 'paddle', got {layout!r}")
    config = CONFIGS[name]
    out_dir = Path(out_dir)
    build_tokenizer(out_dir, vocab_size=config["vocab_size"] if name == "tiny" else 4096)
    _write_weights(out_dir, name, layout, weights if weights is not None else random_weights(config, seed))
    (out_dir / "BUILD").write_text(json.dumps({"name": name, "layout": layout, "seed": seed,
                                               "version": BUILD_VERSION, "init": RANDOM_INIT_VERSION}))
    return out_dir


def _write_weights(out_dir: Path, name: str, layout: str, tensors: dict[str, np.ndarray]) -> None:
    """"-PT" tensors into out_dir (which already holds the tokenizer) as a checkpoint of CONFIGS[name]."""
    config = copy.deepcopy(CONFIGS[name])
    if layout == "paddle":
        tensors = pt_to_paddle(tensors, ErnieModelConfig.from_dict(config))
    from ..tokenizer import ErnieTokenizer

    tok = ErnieTokenizer.from_pretrained(out_dir)
    eos = [i for i in (tok.eos_token_id, tok.token_to_id("<|im_end|>")) if i is not None]
    write_checkpoint(out_dir, config, tensors, max_shard_bytes=64 << 20 if name == "tiny" else 512 << 20,
                     generation_config={"eos_token_id": eos, "bos_token_id": tok.bos_token_id,
                                        "pad_token_id": tok.pad_token_id})


def ensure_tiny_model(path: Path | None = None, show_progress: bool = True) -> Path:
    """Build the embedded model once (under a file lock, so parallel starters don't race).

    Random init, fit to the demo chat set, write. The stamp names the dataset's hash, so editing
    the data rebuilds the model; FIT.json records how the fit went.
    """
    from .dataset import dataset_digest

    path = Path(path or tiny_model_dir())
    stamp = path / "BUILD"
    want = {"name": "tiny", "layout": "pt", "seed": 0, "version": BUILD_VERSION, "data": dataset_digest()}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and json.loads(stamp.read_text()) == want:
            return path
        from .fit import fit_checkpoint, weights_digest  # Paddle: only when the model is built

        log.info("building the embedded tiny ERNIE-4.5 MoE model in %s", path)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tiny-"))
        try:
            # the random init (body + MTP head), and the tokenizer the fit renders prompts with
            config = CONFIGS["tiny"]
            build_checkpoint(tmp, "tiny", weights={**random_weights(config), **random_mtp_weights(config)})
            tensors, fit = fit_checkpoint(tmp, show_progress=show_progress)
            _write_weights(tmp, "tiny", "pt", tensors)
            (tmp / "FIT.json").write_text(json.dumps(
                {"steps": fit.steps, "final_loss": fit.losses[-1], "min_margin": fit.margin,
                 "seconds": round(fit.seconds, 1), "weights_sha256": weights_digest(tensors),
                 "mtp": {"steps": fit.mtp.steps, "final_loss": fit.mtp.losses[-1], "min_margin": fit.mtp.margin,
                         "seconds": round(fit.mtp.seconds, 1)}}, indent=2))
            (tmp / "BUILD").write_text(json.dumps(want))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    return path
