"""A stand-in for a tensor-parallel worker process (ernie_serve.tensor_parallel.workers): it speaks the worker's
control protocol (hello, progress, ready) on the schedule FAKE_RANK_PLAN gives, loads nothing, and then idles
until the driver kills it. Started through a wrapper that drops the `-m module` the driver puts first."""
from __future__ import annotations

import argparse
import json
import os
import time

import zmq


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--rank", "--spec", "--steps", "--control", "--driver-pid"):
        p.add_argument(flag)
    args = p.parse_args()
    # seconds after hello: "progress_for" of loading that ticks every "progress_every" (0: a silent load), then ready
    plan = json.loads(os.environ["FAKE_RANK_PLAN"])
    control = zmq.Context().socket(zmq.PUSH)
    control.connect(args.control)

    def report(kind: str, **extra) -> None:
        control.send(json.dumps({"kind": kind, "rank": int(args.rank), **extra}).encode())

    report("hello")
    start, loaded = time.monotonic(), 0
    while time.monotonic() - start < plan["progress_for"]:
        time.sleep(plan["progress_every"] or plan["progress_for"])
        loaded += 1
        if plan["progress_every"]:
            report("progress", phase="weights", done=loaded)
    report("ready")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
