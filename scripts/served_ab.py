#!/usr/bin/env python3
"""Two servers side by side, measured in alternating runs: is B faster than A?

On a small shared box one served run's tok/s swings by 2x from minute to minute (other tenants, the scheduler on
two cores), so a before/after of two separate runs says little. This starts both servers at once (A and B differ
by environment variables, server flags or model repository), then runs the same streams through each in turn,
A B B A A B ..., and prints every pair, the medians and the median of the per-pair ratios, with each serving
process's CPU ms a token (scripts/served_throughput.py measures one run).

    .venv/bin/python scripts/served_ab.py --b-env KMP_BLOCKTIME=200 --rounds 8 --tokens 256
    .venv/bin/python scripts/served_ab.py --b-repository /tmp/repo_with_a_change --path shim
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))
sys.path.insert(0, str(ROOT / "scripts"))


def _pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def start(env: dict[str, str], flags: dict[str, str], repository: str | None, streams: int):
    """A started TritonServer (and its shim) whose processes see `env` on top of this one's."""
    from served_throughput import make_server, served_settings

    saved = dict(os.environ)
    os.environ.update(env)  # the children inherit it at spawn
    try:
        server = make_server(served_settings(streams, stream_interval=1, **flags),
                             Path(repository) if repository else None)
        server.__enter__()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return server


def main() -> None:
    from served_throughput import served, wait_for_shim

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for side in ("a", "b"):
        ap.add_argument(f"--{side}-env", nargs="*", default=[], metavar="KEY=VALUE")
        ap.add_argument(f"--{side}-flag", nargs="*", default=[], metavar="FLAG=VALUE",
                        help="server settings (max_num_seqs=..., stream_interval=...)")
        ap.add_argument(f"--{side}-repository", default=None, help="a model repository (default: the project's)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--path", choices=("grpc", "http", "shim"), default="grpc")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256, help="tokens each stream generates")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "served_ab.json")
    args = ap.parse_args()

    servers = []
    try:
        for side in ("a", "b"):
            servers.append(start(_pairs(getattr(args, f"{side}_env")), _pairs(getattr(args, f"{side}_flag")),
                                 getattr(args, f"{side}_repository"), args.streams))
        for server in servers:
            wait_for_shim(server)
            served(server, args.path, args.streams, 16)  # warm-up
        runs: list[list] = [[], []]
        for k in range(args.rounds):
            for i in ((0, 1) if k % 2 == 0 else (1, 0)):
                runs[i].append(served(servers[i], args.path, args.streams, args.tokens))
            a, b = runs[0][-1].tok_per_s, runs[1][-1].tok_per_s
            print(f"round {k}: A {a:7.0f}  B {b:7.0f} tok/s  B/A {b / a:.3f}", flush=True)
        summary = {}
        for name, side in zip("AB", runs):
            cpu = {p: statistics.median(r.cpu_ms_per_token.get(p, 0.0) for r in side)
                   for p in side[0].cpu_ms_per_token}
            summary[name] = {"median_tok_per_s": statistics.median(r.tok_per_s for r in side),
                             "median_cpu_ms_per_token": cpu}
            print(f"{name}: median {summary[name]['median_tok_per_s']:.0f} tok/s; median CPU ms a token: "
                  + ", ".join(f"{p} {v:.3f}" for p, v in cpu.items() if v > 0.002))
        ratio = statistics.median(b.tok_per_s / a.tok_per_s for a, b in zip(*runs))
        print(f"median of the per-round ratios B/A: {ratio:.3f}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out"},
                                        "summary": summary, "median_ratio_b_over_a": ratio,
                                        "runs": [[vars(r) for r in side] for side in runs]}, indent=2, default=str))
    finally:
        for server in servers:
            server.__exit__(None, None, None)


if __name__ == "__main__":
    main()
