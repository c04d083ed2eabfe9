"""Write a workload JSON for the peer runners: random prompt token ids, fixed seed.

    python3 scripts/peers/make_workload.py --num-requests 16 --prompt-len 101 --output-len 64 --out uniform.json
    python3 scripts/peers/make_workload.py --num-requests 48 --prompt-len 16-256 --output-len 8-128 --out mixed.json

A length is either N or LO-HI (uniform over the closed range, drawn per request).
Token ids are drawn from [3, vocab_size) so no prompt holds pad/bos/eos (0/1/2 in ERNIE's vocab).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI with 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


def make_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, max_num_seqs: int, ignore_eos: bool, seed: int) -> dict:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        requests.append({"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(n)],
                         "max_tokens": rng.randint(*output_len)})
    return {"requests": requests, "max_num_seqs": max_num_seqs, "ignore_eos": ignore_eos, "seed": seed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, required=True)
    parser.add_argument("--prompt-len", type=parse_range, required=True, help="N or LO-HI")
    parser.add_argument("--output-len", type=parse_range, required=True, help="N or LO-HI")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    w = make_workload(args.num_requests, args.prompt_len, args.output_len, args.vocab_size,
                      args.max_num_seqs, args.ignore_eos, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(w) + "\n")
    p = sum(len(r["prompt_token_ids"]) for r in w["requests"])
    o = sum(r["max_tokens"] for r in w["requests"])
    print(f"wrote {args.out}: {args.num_requests} requests, {p} prompt tokens, {o} output tokens")


if __name__ == "__main__":
    main()
