"""The engine core's step message (engine/core_wire.py): what encoding a step's outputs costs the core and decoding
them costs the front, three ways side by side: the RequestOutput objects pickled, each output as plain tuples
(pack_outputs) pickled, and the columns the wire uses. Streaming (delta) outputs of one token, as a decode step
makes them.

    .venv/bin/python scripts/bench_core_wire.py [--outputs 64,256] [--repeats 300]
"""
from __future__ import annotations

import argparse
import os
import pickle
import time
from pathlib import Path

from ernie_serve.engine.core_wire import decode, encode_step, pack_outputs, unpack_outputs
from ernie_serve.outputs import CompletionOutput, RequestOutput


def plain_outputs(n: int) -> list[RequestOutput]:
    outs = []
    for i in range(n):
        ids = [1000 + i]
        outs.append(RequestOutput(f"req-{i:016x}", None, [], [CompletionOutput(0, "", ids, token_ids_delta=ids)],
                                  False, 0))
    return outs


def per_call_ms(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--outputs", default="64,256")
    p.add_argument("--repeats", type=int, default=300)
    args = p.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"CPU: {cpu}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'outputs':>7} {'way':16} {'encode ms':>10} {'decode ms':>10} {'bytes':>8}")
    stats = {f"counter_{i}": float(i) for i in range(40)}
    for n in (int(x) for x in args.outputs.split(",")):
        outs = plain_outputs(n)
        ways = {
            "pickled objects": (lambda: pickle.dumps(("step", outs, stats), 5), pickle.loads),
            "pickled tuples": (lambda: pickle.dumps(("step", pack_outputs(outs), stats), 5),
                               lambda b: unpack_outputs(pickle.loads(b)[1])),
            "columns (wire)": (lambda: encode_step(outs, stats), decode),
        }
        for name, (enc, dec) in ways.items():
            frame = enc()
            print(f"{n:>7} {name:16} {per_call_ms(enc, args.repeats):>10.3f} "
                  f"{per_call_ms(lambda: dec(frame), args.repeats):>10.3f} {len(frame):>8}")


if __name__ == "__main__":
    main()
