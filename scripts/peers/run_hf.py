"""Peer runner: HF transformers greedy `generate` in static batches.

    .peers/hf/bin/python scripts/peers/run_hf.py --model DIR --workload W.json --out R.json

Requests are taken in file order, max_num_seqs at a time. Each batch is left-padded to its longest
prompt (pad_token_id, attention mask 0; `generate` derives position ids from the mask, so a padded
row sees the same positions as it would alone) and decodes until its longest max_tokens; each row then
keeps only its own max_tokens. That padding and the decode steps spent on rows already done are what
static batching costs, and the result's notes count them.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402


def batches(requests, size):
    for start in range(0, len(requests), size):
        yield requests[start:start + size]


def generation_config(max_new_tokens: int, ignore_eos: bool, eos_token_id, pad_token_id: int) -> GenerationConfig:
    # ignore_eos as vLLM means it: EOS is an ordinary token that does not stop the row. So EOS is
    # not masked (min_new_tokens would mask it and change greedy tokens); it is just not a stop token.
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=None if ignore_eos else eos_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
    )


def run_batch(model, batch, ignore_eos, eos_token_id, pad_token_id):
    longest = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[row, longest - n:] = torch.tensor(r.prompt_token_ids)
        mask[row, longest - n:] = 1
    max_new = max(r.max_tokens for r in batch)
    # set on the model too: generate() fills fields left at their defaults from model.generation_config,
    # which would bring back the checkpoint's eos_token_id
    model.generation_config = generation_config(max_new, ignore_eos, eos_token_id, pad_token_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=model.generation_config)
    new = out[:, longest:].tolist()
    eos = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]) if not ignore_eos else set()
    outputs = []
    for row, r in enumerate(batch):
        tokens = new[row][:r.max_tokens]
        if eos:  # stop after the first EOS, keeping it (as vLLM reports it); the rest is padding
            for i, t in enumerate(tokens):
                if t in eos:
                    tokens = tokens[:i + 1]
                    break
        outputs.append(tokens)
    stats = {
        "padded_prompt_tokens": longest * len(batch) - sum(len(r.prompt_token_ids) for r in batch),
        "decode_slots": len(batch) * (out.shape[1] - longest),
    }
    return outputs, stats


def run_workload(model, workload, eos_token_id, pad_token_id):
    outputs, padded, slots = [], 0, 0
    for batch in batches(workload.requests, workload.max_num_seqs):
        batch_outputs, stats = run_batch(model, batch, workload.ignore_eos, eos_token_id, pad_token_id)
        outputs.extend(batch_outputs)
        padded += stats["padded_prompt_tokens"]
        slots += stats["decode_slots"]
    return outputs, padded, slots


def main() -> None:
    parser = common.make_parser(__doc__.splitlines()[0])
    parser.add_argument("--experts-implementation", default=None,
                        help="transformers' MoE experts kernel: eager, grouped_mm, batched_mm (default: transformers' choice)")
    args = parser.parse_args()
    workload = common.load_workload(args.workload)
    config = common.load_model_config(args.model)
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    extra = {"experts_implementation": args.experts_implementation} if args.experts_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype), **extra).eval()
    load_s = time.perf_counter() - t0
    pad_token_id = config.get("pad_token_id", 0) or 0
    eos_token_id = config.get("eos_token_id", 2)

    warm = common.warmup_requests(workload, args.warmup_tokens, config["vocab_size"])
    t0 = time.perf_counter()
    run_batch(model, warm, workload.ignore_eos, eos_token_id, pad_token_id)
    warmup_s = time.perf_counter() - t0

    cpu0, t0 = common.process_tree_cpu_s(), time.perf_counter()
    outputs, padded, slots = run_workload(model, workload, eos_token_id, pad_token_id)
    elapsed, cpu_s = time.perf_counter() - t0, common.process_tree_cpu_s() - cpu0

    useful = sum(len(o) for o in outputs)
    notes = {
        "batching": f"static batches of max_num_seqs={workload.max_num_seqs} in request order",
        "padding": "left padding with pad_token_id, attention_mask 0 on pads (positions follow the mask); "
                   "each batch decodes to its longest max_tokens and a row keeps only its own max_tokens",
        "eos": "not a stop token (ignore_eos), not masked" if workload.ignore_eos else "stops a row; rows run until all stop",
        "padded_prompt_tokens": padded,
        "decode_slots": slots,
        "discarded_decode_slots": slots - useful,
        "threads": torch.get_num_threads(),
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
    }
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    common.write_result(args.out, "hf-transformers-generate", workload, outputs, elapsed, cpu_s, versions, notes)


if __name__ == "__main__":
    main()
