"""scripts/gpu_aot_check.py compiles the kernels backend's launches for real GPUs on this CPU-only box: here on two
of the seeds' deployments for Ampere and Hopper (the whole matrix is the script's default run). It caught wint8
kernels that compiled for no GPU and spilling tiles on Ampere / Ada that the interpreter cannot see."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = ["21B-A3B tp1 wint8", "300B-A47B tp4 w4a8 c8-static"]


def test_the_seeds_kernels_compile_for_ampere_and_hopper_without_spills(tmp_path):
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    out = tmp_path / "aot.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_aot_check.py"), "--archs", "80", "90",
                          "--json", str(out), "--cases", *CASES], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = json.loads(out.read_text())["kernels"]
    assert {r["config"] for r in records} == set(CASES) and {r["arch"] for r in records} == {"sm_80", "sm_90"}
    names = {r["name"] for r in records}
    assert {"_wo_gemm_kernel", "_fused_moe_kernel", "_unified_attention_kernel", "_kv_write_kernel",
            "_align_count_kernel", "_align_offsets_kernel", "_align_scatter_kernel", "_router_logits_kernel"} <= names
    assert not any(r["tf32"] for r in records if r["name"] == "_router_logits_kernel")  # IEEE fp32, no TF32 MMA
    assert all(r["ok"] and r["shared_bytes"] is not None and r["registers"] for r in records)
