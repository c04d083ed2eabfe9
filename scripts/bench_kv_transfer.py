#!/usr/bin/env python3
"""The P/D KV hand-off, ours (tcp: KVTransfer's frames over pyzmq) against NIXL (UCX reads of registered memory),
side by side on loopback: two processes, a prefill side that offers a prompt's exported blocks and a decode side that
receives them, through the transports the servers use (engine/kv_transport.py) over a pyzmq control connection as
serving/disagg.py's.

    .venv/bin/python scripts/bench_kv_transfer.py                               # print the table
    .venv/bin/python scripts/bench_kv_transfer.py --json benchmarks/results/kv_transfer.json

Timed per hand-off: from the prefill side's offer (tcp: the frames; nixl: registering the arrays and their
metadata) to the decode side holding the KVTransfer (tcp: received and wrapped without a copy; nixl: its arrays
registered, read, polled to the end). Not timed: exporting from the prefill cache and importing into the decode
cache, which are the same for both. The blocks are the shape of ERNIE-4.5-21B-A3B's KV (28 layers, 4 KV heads, head
dim 128, blocks of 64 tokens) in the formats a cache holds: bfloat16 (the GPU cache), C8 (int8 codes and one scale
per block and head) and float32 (the CPU cache). The decode side checks a CRC of every hand-off's bytes.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import zlib
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 28, 4, 128, 64  # ERNIE-4.5-21B-A3B
FORMATS = ("bfloat16", "c8", "float32")


def blocks_for(tokens: int, fmt: str, seed: int):
    """A prompt's blocks in `fmt`, random bytes (the transports do not look at values)."""
    import ml_dtypes

    from ernie_serve.kv_blocks import KVBlocks

    n = -(-tokens // BLOCK)
    shape = (LAYERS, 2, n, BLOCK, KV_HEADS, HEAD_DIM)
    rng = np.random.default_rng(seed)
    if fmt == "c8":
        codes = rng.integers(-127, 128, size=shape, dtype=np.int8)
        return KVBlocks(codes, "dynamic", rng.random((LAYERS, 2, n, KV_HEADS), dtype=np.float32))
    raw = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    if fmt == "bfloat16":
        return KVBlocks(raw.view(ml_dtypes.bfloat16))
    return KVBlocks((raw.astype(np.uint32) << 16).view(np.float32))  # bfloat16 values widened: no NaN patterns


def crc(arrays) -> int:
    value = 0
    for a in arrays:
        value = zlib.crc32(a, value)
    return value


TRANSPORTS = ("tcp", "nixl")


def prefill_side(port: int, cases: list, repeats: int, out) -> None:
    """Offers each case `repeats` times over each transport, the two alternating (so both see the same load), after
    one warm-up hand-off each, and reports the decode side's times."""
    import zmq

    from ernie_serve.engine.kv_transfer import KVTransfer
    from ernie_serve.engine.kv_transport import make_sender

    senders = {name: make_sender(name, "bench") for name in TRANSPORTS}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    owner, kind, _ = sock.recv_multipart()
    assert kind == b"hello"
    sock.send_multipart([owner, b"hello", json.dumps({n: s.hello() for n, s in senders.items()}).encode()])
    rows = []
    for case, (tokens, fmt) in enumerate([(1024, "bfloat16"), *cases]):  # the first: warm-up, not reported
        blocks = blocks_for(tokens, fmt, tokens)
        want = crc(blocks.arrays())
        times: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
        for i in range(repeats):
            for name in (TRANSPORTS if i % 2 == 0 else TRANSPORTS[::-1]):
                sender = senders[name]
                transfer = KVTransfer(f"{fmt}-{tokens}-{name}-{i}", list(range(tokens)), [], tokens, BLOCK, blocks)
                t0 = time.monotonic()
                body = sender.offer(transfer)
                sock.send_multipart([owner, name.encode(), *body], copy=False)
                while not sock.poll(1):  # as the prefill server's socket thread does while an offer is out
                    sender.progress()
                _, _, done = sock.recv_multipart()
                reply = json.loads(done)
                sender.release(transfer.request_id)
                if reply["crc"] != want:
                    raise SystemExit(f"{name}: the bytes of {fmt} x {tokens} tokens arrived changed")
                times[name].append(reply["t1"] - t0)
        rows.append({name: {"tokens": tokens, "format": fmt, "bytes": blocks.nbytes,
                            "seconds": statistics.median(times[name]), "all": times[name]} for name in TRANSPORTS})
        del blocks
    sock.send_multipart([owner, b"bye", b""])
    for sender in senders.values():
        sender.close()
    sock.close(0)
    ctx.term()
    out.send(rows[1:])


def decode_side(port: int) -> None:
    import zmq

    from ernie_serve.engine.kv_transport import make_receiver

    receivers = {name: make_receiver(name, "bench") for name in TRANSPORTS}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"hello", b"{}"])
    kind, hello = sock.recv_multipart()
    for name, answer in json.loads(hello).items():
        receivers[name].connect(answer)
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[0].bytes == b"bye":
            break
        receiver = receivers[frames[0].bytes.decode()]
        receiver.receive(frames[1:])
        done = []
        while not done:
            done = receiver.poll()
        t1 = time.monotonic()  # CLOCK_MONOTONIC: one clock for both processes of a host
        (got,) = done
        if got.error:
            raise SystemExit(got.error)
        sock.send_multipart([b"done", json.dumps({"t1": t1, "crc": crc(got.transfer.blocks.arrays())}).encode()])
        del got, done
    for receiver in receivers.values():
        receiver.close()
    sock.close(0)
    ctx.term()


def run(cases: list, repeats: int) -> dict[str, list[dict]]:
    from ernie_serve.ports import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=prefill_side, args=(port, cases, repeats, child))
    d = ctx.Process(target=decode_side, args=(port,))
    p.start()
    d.start()
    rows = parent.recv()
    p.join(60)
    d.join(60)
    return {name: [row[name] for row in rows] for name in TRANSPORTS}


def cpu() -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Model name")), "?")
    return f"{model} ({os.cpu_count()} vCPUs), loopback, one host"


def commit() -> str:
    git = ["git", "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True, cwd=ROOT).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--tokens", default="1024,8192,32768", help="prompt lengths (comma-separated)")
    a.add_argument("--formats", default=",".join(FORMATS), help=f"KV formats among {', '.join(FORMATS)}")
    a.add_argument("--max-bytes", type=float, default=2.0, help="skip cases whose KV is larger (GiB): both sides "
                                                                "hold a copy, and tcp's receive one more")
    a.add_argument("--repeats", type=int, default=3, help="hand-offs per case (the median is reported)")
    a.add_argument("--json", help="write the result file here (benchmarks/results/ schema)")
    args = a.parse_args(argv)
    cases = [(int(t), f) for t in args.tokens.split(",") for f in args.formats.split(",")
             if blocks_nbytes(int(t), f) <= args.max_bytes * (1 << 30)]
    load = [os.getloadavg()[0]]
    results = run(cases, args.repeats)
    load.append(os.getloadavg()[0])
    columns = ["prompt tokens", "KV format", "KV MiB", "tcp (ours) ms", "NIXL ms", "tcp GB/s", "NIXL GB/s",
               "NIXL / tcp time", "tcp best ms", "NIXL best ms"]
    rows = []
    for tcp, nixl in zip(results["tcp"], results["nixl"]):
        mib = tcp["bytes"] / (1 << 20)
        rows.append([tcp["tokens"], tcp["format"], round(mib, 1), round(tcp["seconds"] * 1e3, 1),
                     round(nixl["seconds"] * 1e3, 1), round(tcp["bytes"] / tcp["seconds"] / 1e9, 2),
                     round(nixl["bytes"] / nixl["seconds"] / 1e9, 2), round(nixl["seconds"] / tcp["seconds"], 2),
                     round(min(tcp["all"]) * 1e3, 1), round(min(nixl["all"]) * 1e3, 1)])
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(columns)]
    print("  ".join(str(c).rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(v).rjust(w) for v, w in zip(r, widths)))
    if args.json:
        skipped = [f"{f} x {t}" for t in args.tokens.split(",") for f in args.formats.split(",")
                   if (int(t), f) not in cases]
        result = {
            "title": "P/D KV hand-off on loopback: ours (tcp, pyzmq frames) against NIXL (UCX), ERNIE-4.5-21B-A3B's "
                     "KV shape",
            "commit": commit(), "cpu": cpu(),
            "command": ".venv/bin/python " + " ".join(["scripts/bench_kv_transfer.py", *(argv or sys.argv[1:])]),
            "date": date.today().isoformat(), "columns": columns, "rows": rows,
            "notes": [
                "Time from the prefill side's offer to the decode side holding the blocks, median of "
                f"{args.repeats} hand-offs over each transport, the two alternating, after one warm-up each; two "
                "processes on one host; the decode side checks a "
                "CRC of every hand-off's bytes. Exporting from and importing into the caches is not timed (the same "
                "for both). Best: the fastest of the hand-offs.",
                f"Load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, on a host shared with other "
                "jobs: single hand-offs scatter widely, so compare within a row; the best shows each path with the "
                "least interference.",
                "KV of 28 layers x 4 KV heads x head dim 128 (ERNIE-4.5-21B-A3B) in blocks of 64 tokens: bfloat16 "
                "is the GPU cache's format, C8 int8 codes with one float32 scale per block and head, float32 the "
                "CPU cache's.",
                "NIXL 1.5.1 (nixl-cu12), UCX backend, UCX's own choice between two processes of one host: READs by "
                "cross-memory attach (cma, one kernel copy; UCX_PROTO_INFO=y shows it). Across hosts UCX takes RDMA "
                "verbs where the NICs are, which loopback does not measure.",
                *([f"Skipped (larger than --max-bytes {args.max_bytes:g} GiB): {', '.join(skipped)}."] if skipped
                  else []),
            ]}
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def blocks_nbytes(tokens: int, fmt: str) -> int:
    n = -(-tokens // BLOCK)
    per = LAYERS * 2 * n * BLOCK * KV_HEADS * HEAD_DIM
    return {"bfloat16": 2 * per, "float32": 4 * per, "c8": per + LAYERS * 2 * n * KV_HEADS * 4}[fmt]


if __name__ == "__main__":
    sys.exit(main())
