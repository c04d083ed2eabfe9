"""Speculative decoding on the demo chats: steps saved and draft acceptance, plain vs ngram vs MTP, side by side.

    .venv/bin/python scripts/bench_spec_decode.py            # greedy, every demo chat, max 160 tokens each
    .venv/bin/python scripts/bench_spec_decode.py --temperature 1.0

Every configuration runs the same requests on the embedded tiny model (whose MTP head is fitted on these
chats) in one process. Greedy outputs are checked identical to plain decoding. Prints a table and writes
out/bench_spec_decode.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "plain": None,
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3},
    "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
    "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2},
    "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_spec_decode.json")
    args = ap.parse_args()

    from ernie_serve import LLM, SamplingParams
    from ernie_serve.paths import demo_data_dir

    rows = [json.loads(line) for line in (demo_data_dir() / "chat_demo.jsonl").read_text().splitlines() if line]
    results, reference = {}, None
    for name, spec in tqdm(CONFIGS.items(), desc="configurations", unit="config"):
        llm = LLM(model=None, max_model_len=2048, max_num_seqs=16, disable_progress_bar=True, speculative_config=spec)
        prompts = [llm.tokenizer.apply_chat_template(r["messages"], tools=r.get("tools"), tokenize=True,
                                                     **r.get("chat_template_kwargs", {})) for r in rows]
        params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
                  for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = [o.outputs[0].token_ids for o in outs]
        reference = reference or tokens
        s = llm.engine.stats()
        n = sum(map(len, tokens))
        results[name] = {"requests": len(outs), "tokens": n, "steps": s["num_steps"], "tokens_per_step": n / s["num_steps"],
                         "draft_tokens": s["spec_draft_tokens"], "accepted": s["spec_accepted_tokens"],
                         "acceptance_rate": s["spec_acceptance_rate"], "seconds": seconds,
                         "identical_to_plain": tokens == reference}
    print(f"\n{len(rows)} demo chats, temperature {args.temperature}, max_tokens {args.max_tokens}")
    print(f"{'config':10s} {'tokens':>7s} {'steps':>6s} {'tok/step':>8s} {'drafts':>7s} {'accepted':>8s} "
          f"{'rate':>6s} {'seconds':>8s}  same as plain")
    for name, r in results.items():
        print(f"{name:10s} {r['tokens']:7d} {r['steps']:6d} {r['tokens_per_step']:8.2f} {r['draft_tokens']:7d} "
              f"{r['accepted']:8d} {r['acceptance_rate']:6.2f} {r['seconds']:8.2f}  {r['identical_to_plain']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"temperature": args.temperature, "max_tokens": args.max_tokens,
                                    "results": results}, indent=2))


if __name__ == "__main__":
    main()
