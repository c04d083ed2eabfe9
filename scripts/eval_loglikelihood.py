"""lm-evaluation-harness's loglikelihood tasks against the served deployment, checked against the offline engine.

How a user checks that a deployment (a wint4 / W4A8 / C8 one, say) kept its accuracy: lm-eval's `local-completions`
model sends each (context, continuation) as token ids with echo + logprobs to the OpenAI shim, tokenized by the
server's own tokenizer (`tokenizer_backend=remote`: the shim's /tokenize), and sums the continuation's prompt
logprobs. This script starts tritonserver and the shim (the launcher, free ports) on --model, runs lm-eval on
--tasks, then scores the same token ids with the offline LLM's own prompt logprobs and prints both accuracies and the
largest difference between the two loglikelihoods of any choice.

lm-eval is not a dependency of the project (it pulls datasets, pandas, pyarrow, ... at versions the engine's
environment does not take): install it in an environment of its own and name its `lm_eval` here; it only speaks
HTTP to the shim. From the repository root:
    python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm-eval[api]==0.4.13"
    .venv/bin/python scripts/eval_loglikelihood.py --lm-eval /tmp/lmeval/bin/lm_eval     # demo model and task
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "backend"), str(ROOT / "client"), str(ROOT / "scripts")]


def encode_pair(encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's rule (TemplateLM._encode_pair): trailing spaces of the context move to the continuation, and the
    continuation's ids are the whole text's after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = encode(context + continuation), encode(context)
    return ctx, whole[len(ctx):]


def offline_loglikelihoods(llm, tokenizer, pairs: list[tuple[str, str]]) -> list[float]:
    """Each continuation's summed logprob from the offline engine's prompt logprobs over the same ids."""
    from ernie_serve import SamplingParams

    encoded = [encode_pair(lambda t: tokenizer.encode(t, add_special_tokens=False), c, x) for c, x in pairs]
    prompts = [ctx + cont for ctx, cont in encoded]
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=True,
                        sampling_params=SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    lls = []
    for (ctx, cont), ids, out in zip(encoded, prompts, outs):
        lls.append(sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(len(ctx), len(ids))))
    return lls


def run_lm_eval(lm_eval: str, base_url: str, args, out_dir: Path) -> None:
    """lm-eval's CLI in its own environment against the shim, its samples logged to out_dir."""
    import subprocess

    cmd = [lm_eval, "--model", "local-completions", "--tasks", args.tasks, "--include_path", args.include_path,
           "--model_args", f"model=ernie,base_url={base_url},tokenizer_backend=remote,"
                           f"num_concurrent={args.num_concurrent},max_retries=1",
           "--output_path", str(out_dir), "--log_samples"] + (["--limit", str(args.limit)] if args.limit else [])
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def read_lm_eval(out_dir: Path) -> tuple[dict, dict[str, list[dict]]]:
    """The newest results file and each task's logged samples."""
    results = json.loads(max(out_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())
    samples = {}
    for task in results["results"]:
        path = max(out_dir.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
        samples[task] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return results, samples


def _pairs(sample: dict) -> list[tuple[str, str]]:
    """A logged sample's (context, continuation) requests: lm-eval logs them as {"gen_args_i": {"arg_0", "arg_1"}}."""
    args = sample["arguments"]
    if isinstance(args, dict):
        return [(a["arg_0"], a["arg_1"]) for _, a in sorted(args.items(), key=lambda kv: int(kv[0].split("_")[-1]))]
    return [tuple(a) for a in args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", default=shutil.which("lm_eval"), help="lm-eval's CLI (default: lm_eval on PATH)")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny demo model)")
    ap.add_argument("--tasks", default="ernie_demo_facts", help="lm-eval task names, comma-separated")
    ap.add_argument("--include-path", default=str(ROOT / "eval"), help="where lm-eval finds local task YAMLs")
    ap.add_argument("--limit", type=int, default=None, help="documents per task (lm-eval's --limit)")
    ap.add_argument("--num-concurrent", type=int, default=4)
    ap.add_argument("--server-flag", action="append", default=[], metavar="KEY=VALUE",
                    help="an ernie-serve setting for both sides (quantization=wint8, ...); repeatable")
    ap.add_argument("--out", default=str(ROOT / "out" / "eval_loglikelihood"))
    args = ap.parse_args()
    if not args.lm_eval:
        sys.exit("lm-eval's CLI was not found: install it as this script's docstring says and pass --lm-eval")
    from ernie_serve import LLM
    from ernie_serve.config import EngineConfig
    from ernie_serve.engine.llm_engine import resolve_model_dir
    from ernie_serve.tokenizer import ErnieTokenizer
    from served_throughput import make_server, wait_for_shim

    flags = dict(f.split("=", 1) for f in args.server_flag)
    out_dir = Path(args.out)
    server = make_server({"max_model_len": 2048, **flags, **({"model": args.model} if args.model else {})})
    try:
        server.start(timeout=600)
        wait_for_shim(server)
        run_lm_eval(args.lm_eval, f"http://127.0.0.1:{server.openai_port}/v1/completions", args, out_dir)
    finally:
        server.stop()
        server.cleanup()
    results, samples = read_lm_eval(out_dir)

    tokenizer = ErnieTokenizer.from_pretrained(resolve_model_dir(EngineConfig(model=args.model)))
    llm = LLM(args.model, max_model_len=2048, enable_logprob=True, **flags)
    report = {}
    for task, docs in samples.items():
        pairs = [p for s in docs for p in _pairs(s)]
        served_ll = [float(r[0][0]) for s in docs for r in s["resps"]]
        offline_ll = offline_loglikelihoods(llm, tokenizer, pairs)
        at, correct = 0, []
        for s in docs:
            n = len(_pairs(s))
            correct.append(int(np.argmax(offline_ll[at:at + n])) == int(s["target"]))
            at += n
        served_acc = results["results"][task]["acc,none"]
        r = report[task] = {"documents": len(docs), "requests": len(pairs), "served_acc": served_acc,
                            "offline_acc": float(np.mean(correct)),
                            "max_abs_loglikelihood_diff": float(np.max(np.abs(np.subtract(served_ll, offline_ll))))}
        print(f"{task}: {r['documents']} documents, {r['requests']} loglikelihood requests; accuracy served "
              f"{served_acc:.4f}, offline {r['offline_acc']:.4f}; largest |loglikelihood difference| "
              f"{r['max_abs_loglikelihood_diff']:.2e}")
    llm.engine.close()
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
