"""The serving benchmark's request trace: text prompts of an exact token length, one fixed output length.

A served request carries text, and each server tokenizes it itself, so a prompt is the same work for two
servers only if their tokenizers give the same ids. The trace therefore keeps both: `text` (what aiperf
sends) and `prompt_token_ids` (what our tokenizer makes of it, what the offline engine is given, and what
`check_tokenizer_agrees` compares a peer's tokenizer against).

The file is a workload file (scripts/peers/common.py: `requests` with `prompt_token_ids` and `max_tokens`)
with a `text` per request; `write_aiperf_input` turns it into aiperf's `single_turn` JSONL.

Standard library only; the tokenizer is passed in (anything with encode/decode/all_special_ids/__len__).
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Protocol, Sequence

MAX_ATTEMPTS = 100


class Tokenizer(Protocol):
    all_special_ids: set[int]

    def __len__(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


def word_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids that decode to visible text on their own (no special tokens, no lone UTF-8 byte pieces)."""
    out = []
    for i in range(len(tokenizer)):
        if i in tokenizer.all_special_ids:
            continue
        text = tokenizer.decode([i])
        if text.strip() and "\ufffd" not in text:
            out.append(i)
    return out


def text_prompt(tokenizer: Tokenizer, candidates: Sequence[int], length: int, rng: random.Random) -> tuple[str, list[int]]:
    """A text whose encoding is exactly `length` ids, and those ids.

    Random pieces decoded and re-encoded are not the same ids (pieces merge at their seams), so the
    re-encoding is cut to `length` and kept only if its own text encodes back to it."""
    for _ in range(MAX_ATTEMPTS):
        ids = tokenizer.encode(tokenizer.decode([rng.choice(candidates) for _ in range(length + 8)]))[:length]
        text = tokenizer.decode(ids)
        if len(ids) == length and tokenizer.encode(text) == ids:
            return text, ids
    raise RuntimeError(f"no {length}-token prompt that survives decode/encode in {MAX_ATTEMPTS} attempts")


def make_trace(tokenizer: Tokenizer, num_requests: int, prompt_len: int, output_len: int, max_num_seqs: int,
               seed: int) -> dict:
    rng = random.Random(seed)
    candidates = word_ids(tokenizer)
    requests = []
    for _ in range(num_requests):
        text, ids = text_prompt(tokenizer, candidates, prompt_len, rng)
        requests.append({"text": text, "prompt_token_ids": ids, "max_tokens": output_len})
    return {"requests": requests, "max_num_seqs": max_num_seqs, "ignore_eos": True, "seed": seed,
            "tokenizer_size": len(tokenizer)}


def write_aiperf_input(trace: dict, path: Path) -> Path:
    """aiperf's single_turn JSONL: one {"text", "output_length"} per line, in trace order."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in trace["requests"]:
            f.write(json.dumps({"text": r["text"], "output_length": r["max_tokens"]}) + "\n")
    return path


def tokenizer_disagreements(trace: dict, encoded: list[list[int]]) -> list[int]:
    """Indexes of the requests whose ids from another tokenizer differ from the trace's."""
    if len(encoded) != len(trace["requests"]):
        raise ValueError(f"{len(encoded)} encodings for {len(trace['requests'])} requests")
    return [i for i, (r, ids) in enumerate(zip(trace["requests"], encoded)) if r["prompt_token_ids"] != ids]


def main() -> None:
    """Print, as JSON, the ids transformers' AutoTokenizer gives each prompt of a trace: run from a peer's
    venv, that is what the peer's server will compute from the same text."""
    import argparse

    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (the checkpoint)")
    parser.add_argument("--trace", type=Path, required=True)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    trace = json.loads(args.trace.read_text())
    # the servers' completions path: the prompt text as is, special tokens as tokenizer_config.json says
    print(json.dumps({"tokenizer_class": type(tokenizer).__name__,
                      "encoded": [tokenizer(r["text"])["input_ids"] for r in trace["requests"]]}))


if __name__ == "__main__":
    main()
