"""What both peer runners share: the workload file, the checkpoint check, thread pinning, the result file.

Standard library only: each runner imports this from its own peer venv.

Workload file:  {"requests": [{"prompt_token_ids": [...], "max_tokens": N}, ...],
                 "max_num_seqs": 16, "ignore_eos": true}
Result file:    {"name", "elapsed_s", "output_tokens", "prompt_tokens", "tokens_per_s",
                 "outputs": [[ids...], ...] (in request order), "versions": {...}, "notes": {...}}
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

EXPECTED_ARCHITECTURE = "Ernie4_5_MoeForCausalLM"


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class Workload:
    requests: list[Request]
    max_num_seqs: int
    ignore_eos: bool

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)


def load_workload(path: Path) -> Workload:
    data = json.loads(Path(path).read_text())
    raw = data.get("requests")
    if not raw:
        raise SystemExit(f"{path}: 'requests' must be a non-empty list")
    requests = []
    for i, r in enumerate(raw):
        ids, n = r.get("prompt_token_ids"), r.get("max_tokens")
        if not ids or not all(isinstance(t, int) for t in ids):
            raise SystemExit(f"{path}: request {i}: prompt_token_ids must be a non-empty list of ints")
        if not isinstance(n, int) or n < 1:
            raise SystemExit(f"{path}: request {i}: max_tokens must be an int >= 1, got {n!r}")
        requests.append(Request(list(ids), n))
    max_num_seqs = data.get("max_num_seqs", 16)
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise SystemExit(f"{path}: max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
    return Workload(requests, max_num_seqs, bool(data.get("ignore_eos", True)))


def load_model_config(model_dir: Path) -> dict:
    """The checkpoint's config.json, after checking it is the ERNIE-4.5 MoE HF layout the peers run."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise SystemExit(f"{model_dir}: no config.json; --model must be an HF '-PT' checkpoint directory")
    config = json.loads(path.read_text())
    archs = config.get("architectures") or []
    if EXPECTED_ARCHITECTURE not in archs:
        raise SystemExit(f"{path}: architectures is {archs}, expected [{EXPECTED_ARCHITECTURE!r}] "
                         "(the '-Paddle' layout names Ernie4_5_MoeForCausalLM too, but only '-PT' loads in torch peers)")
    if not any(p.suffix == ".safetensors" for p in Path(model_dir).iterdir()):
        raise SystemExit(f"{model_dir}: no *.safetensors files")
    return config


def warmup_requests(workload: Workload, max_tokens: int, vocab_size: int) -> list[Request]:
    """One batch shaped like the workload's first, with other token ids, so no prefix cache can
    carry the warm-up into the timed run."""
    return [Request([(t + 7919) % (vocab_size - 3) + 3 for t in r.prompt_token_ids], min(r.max_tokens, max_tokens))
            for r in workload.requests[:workload.max_num_seqs]]


def process_tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds used so far by process `root` (default: this one) and its live descendants (vLLM
    computes in a child; a server's workers are children of the server).

    The box is shared, so wall time depends on what else runs; CPU time alongside it shows how much of
    the wall time this peer actually had the cores."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                # fields after the ')' that ends the command name: state ppid ... utime(12) stime(13)
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    tree, frontier = set(), {os.getpid() if root is None else root}
    while frontier:
        tree |= frontier
        frontier = {pid for pid, (ppid, _) in stats.items() if ppid in frontier and pid not in tree}
    return sum(stats[pid][1] for pid in tree if pid in stats) / tick


def cpu_list() -> list[int]:
    """The CPUs this process may run on (a cgroup/taskset may give fewer than os.cpu_count())."""
    return sorted(os.sched_getaffinity(0))


def make_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", type=Path, required=True, help="HF '-PT' ERNIE-4.5 MoE checkpoint directory")
    parser.add_argument("--workload", type=Path, required=True, help="workload JSON (see scripts/peers/README.md)")
    parser.add_argument("--out", type=Path, required=True, help="result JSON to write")
    parser.add_argument("--threads", type=int, default=len(cpu_list()),
                        help="compute threads (default: every CPU this process may use)")
    parser.add_argument("--warmup-tokens", type=int, default=4,
                        help="max_tokens of the untimed warm-up run over the first batch's prompts")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the weights' and activations' dtype (every system of a run gets the same)")
    return parser


def write_result(path: Path, name: str, workload: Workload, outputs: list[list[int]], elapsed_s: float,
                 cpu_s: float, versions: dict, notes: dict) -> dict:
    if len(outputs) != len(workload.requests):
        raise RuntimeError(f"{name}: {len(outputs)} outputs for {len(workload.requests)} requests")
    output_tokens = sum(len(o) for o in outputs)
    result = {
        "name": name,
        "elapsed_s": round(elapsed_s, 4),
        "output_tokens": output_tokens,
        "prompt_tokens": workload.prompt_tokens,
        "tokens_per_s": round(output_tokens / elapsed_s, 2),
        # CPU seconds of the process tree during the timed run; with T threads, cpu_s well under
        # T * elapsed_s means other work on the box took the cores
        "cpu_s": round(cpu_s, 2),
        "num_requests": len(workload.requests),
        "max_num_seqs": workload.max_num_seqs,
        "ignore_eos": workload.ignore_eos,
        "outputs": outputs,
        "versions": {"python": platform.python_version(), **versions},
        "notes": notes,
        # the box is shared: a 1-minute load average well above the thread count means the figure is low
        "host": {"cpus": cpu_list(), "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                 "cpu_share": round(cpu_s / (elapsed_s * len(cpu_list())), 3)},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result) + "\n")
    print(f"{name}: {len(outputs)} requests, {output_tokens} output tokens in {elapsed_s:.2f}s "
          f"= {result['tokens_per_s']} tok/s -> {path}")
    return result
