"""The production path on a GPU: Paddle GPU tensors into the triton kernels (through paddle.enable_compat), the path
the production image runs and the torch checks (gpu_engine_check.py) cannot reach. scripts/gpu_check.sh runs it first
wherever Paddle with CUDA is installed; a box with torch only skips it and says so in its output.

Each check is an entry of gpu_paddle_check.json in --out:
  - launch: the module triton's driver takes each launch's stream and device from (Paddle's, not torch's);
  - forced: the kernels backend's teacher-forced logits on Paddle against the reference backend's (float32) on the
    same checkpoint, and top-1 agreement;
  - graphs: greedy tokens with CUDA graphs equal to eager ones;
  - memory: load time, weight bytes, KV blocks, and the device's peak while decoding;
  - decode: step time and tok/s at 1 / 16 / 64 running (graphs off and on);
  - data_parallel (two GPUs visible): two replicas pinned the way ernie_moe pins its instances
    (serving/instance_devices.py) each allocate on their own GPU, read back per GPU with nvidia-smi.

    python scripts/gpu_paddle_check.py --out $OUT                 # a GPU with paddlepaddle-gpu >= 3.3
    python scripts/gpu_paddle_check.py --cpu-smoke --out /tmp/x   # Paddle CPU tensors in triton's interpreter (CI)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_env import ROOT, prepare

SMOKE = prepare("paddle")

from gpu_check_common import (decode_rate, forced_sequences, log, logit_error, prefill_step,  # noqa: E402
                              write_bench_checkpoint)

GiB = 1 << 30
DP_CHILD_BYTES = 2 * GiB


def launch_binding() -> dict:
    """Where triton's active driver takes each launch's stream and device from."""
    if SMOKE:
        return {"checked": False, "why": "triton's interpreter has no GPU driver"}
    from ernie_kernels._runtime import process_framework  # sets up the compat layer before triton's driver is made
    from triton.runtime.driver import driver

    active = driver.active
    stream, device = active.get_current_stream.__module__, active.get_current_device.__module__
    return {"checked": True, "framework": process_framework(), "stream_from": stream, "device_from": device,
            "ok": stream.startswith("paddle") and device.startswith("paddle")}


def forced_logits(llm, seqs: list[list[int]], block_size: int):
    _, logits = llm.engine.runner.executor.execute(prefill_step(seqs, block_size))
    return logits.numpy()


def greedy_tokens(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from ernie_serve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def nvidia_memory_used() -> dict[int, int]:
    """MiB used on each GPU by index (nvidia-smi numbers GPUs by PCI bus, as CUDA_DEVICE_ORDER=PCI_BUS_ID does)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return {int(i): int(m) for i, m in (line.split(",") for line in out.strip().splitlines())}


def data_parallel(device_count: int) -> dict:
    """Two replicas, pinned by instance_gpus as two ernie_moe instances would be, each holding DP_CHILD_BYTES on
    its GPU 0: the memory must show up on two different physical GPUs."""
    from ernie_serve.serving.instance_devices import instance_gpus

    if device_count < 2:
        return {"checked": False, "why": f"{device_count} GPU visible; two needed"}
    config = json.dumps({"instance_group": [{"count": 2, "kind": "KIND_CPU"}]})
    before = nvidia_memory_used()
    children, pinned = [], []
    for k in range(2):
        args = {"model_instance_name": f"ernie_moe_0_{k}", "model_instance_kind": "CPU", "model_config": config}
        gpus = instance_gpus(args, 1, None, device_count)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        child = subprocess.Popen([sys.executable, __file__, "--dp-child"], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        children.append(child)
        pinned.append(gpus)
    try:
        ready = [c.stdout.readline().strip() for c in children]
        after = nvidia_memory_used()
    finally:
        for c in children:
            c.stdin.close()
            c.wait(timeout=60)
    grew = {i: after[i] - before.get(i, 0) for i in after}
    want = DP_CHILD_BYTES / 2**20 * 0.9
    return {"checked": True, "pinned": pinned, "ready": ready, "mib_grown_by_gpu": grew,
            "ok": all(grew.get(int(g[0]), 0) >= want for g in pinned)}


def dp_child() -> None:
    import paddle

    paddle.set_device("gpu:0")
    held = paddle.zeros([DP_CHILD_BYTES // 4], dtype="float32")
    paddle.device.synchronize()
    print(f"ready {os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
    sys.stdin.read()  # hold it until the parent has read the GPUs' memory
    del held


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "out")))
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--dp-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dp_child:
        dp_child()
        return 0
    import paddle

    from ernie_serve import LLM

    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    on_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if not SMOKE and not on_gpu:
        print("gpu_paddle_check: this Paddle sees no CUDA GPU (a CPU build, or no GPU visible); nothing checked")
        return 2
    batches = [1, 2] if SMOKE else [1, 16, 64]
    steps, prompt_len, n_forced, forced_len, block = (2, 8, 2, 12, 16) if SMOKE else (32, 32, 4, 64, 64)
    report: dict = {"paddle": paddle.__version__, "smoke": SMOKE, "errors": [],
                    "device": "cpu (triton interpreter)" if SMOKE else paddle.device.cuda.get_device_name()}
    report["launch"] = launch_binding()
    ckpt, config = write_bench_checkpoint(args.out, SMOKE)
    vocab = config["vocab_size"]
    seqs = forced_sequences(vocab, n_forced, forced_len)
    log(f"checkpoint {ckpt}; reference logits (reference backend, float32)")
    ref_llm = LLM(model=str(ckpt), execution_backend="reference", dtype="float32", skip_tokenizer_init=True,
                  max_model_len=256, block_size=block, disable_progress_bar=True)
    ref = forced_logits(ref_llm, seqs, block)
    del ref_llm
    kw = dict(model=str(ckpt), execution_backend="kernels", skip_tokenizer_init=True, max_num_seqs=max(batches),
              max_model_len=256, block_size=block, disable_progress_bar=True)
    eager_tokens = None
    for graphs in [False] if SMOKE else [False, True]:
        try:
            t0 = time.perf_counter()
            llm = LLM(use_cudagraph=graphs, **kw)
            shard = llm.engine.runner.executor
            entry = report.setdefault("memory", {})
            entry[f"load_s_graphs_{graphs}"] = time.perf_counter() - t0
            entry["weight_bytes"] = shard.model.weights.nbytes
            entry[f"kv_blocks_graphs_{graphs}"] = shard.cache.num_blocks
            if not graphs:
                report["forced"] = logit_error(forced_logits(llm, seqs, block), ref)
                log(f"forced logits against the reference: {report['forced']}")
            tokens = greedy_tokens(llm, seqs[:2], 8)
            if graphs:
                report["graphs"] = {"replays": shard.graphs.replays, "same_tokens": tokens == eager_tokens}
            eager_tokens = tokens if not graphs else eager_tokens
            shard.ops.reset_peak()
            for b in batches:
                r = decode_rate(llm, b, prompt_len, steps, vocab)
                r["cuda_graphs"] = graphs
                report.setdefault("decode", []).append(r)
                log(f"graphs={graphs} batch {b}: {r['tok_s']:.0f} tok/s, {r['step_ms']:.2f} ms a step")
            entry[f"decode_peak_bytes_graphs_{graphs}"] = shard.ops.peak_allocated()
            del llm, shard
        except Exception as e:  # one mode failing must not hide the others' figures
            report["errors"].append(f"graphs={graphs}: {type(e).__name__}: {e}")
            log(report["errors"][-1])
    report["data_parallel"] = ({"checked": False, "why": "CPU smoke run"} if SMOKE
                               else data_parallel(paddle.device.cuda.device_count()))
    report["seconds"] = time.perf_counter() - start
    (args.out / "gpu_paddle_check.json").write_text(json.dumps(report, indent=2))
    failed = [name for name in ("launch", "graphs", "data_parallel")
              if report.get(name, {}).get("checked", True) and report.get(name, {}).get("ok", True) is False]
    if "graphs" in report and not report["graphs"]["same_tokens"]:
        failed.append("graphs")
    forced = report.get("forced", {})
    if forced and forced["top1_agreement"] < (1.0 if SMOKE else 0.95):
        failed.append("forced")
    print(json.dumps({k: report.get(k) for k in ("device", "launch", "forced", "graphs", "data_parallel")}, indent=1))
    print(f"gpu_paddle_check: {len(report['errors'])} errors, failed: {failed or 'none'}; {report['seconds']:.0f} s")
    return 1 if report["errors"] or failed else 0


if __name__ == "__main__":
    sys.exit(main())
