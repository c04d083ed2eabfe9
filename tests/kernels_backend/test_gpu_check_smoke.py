"""scripts/gpu_check.sh in CPU smoke mode: the production path's check (Paddle tensors into the kernels, against the
reference backend), the kernel checks and the engine end to end (LLM with the kernels backend, torch tensors, triton
interpreter) against HF transformers' fp32 model, JSON written."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_in_cpu_smoke_mode(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--cpu-smoke"], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((tmp_path / "gpu_kernel_check.json").read_text())["all_correct"]
    report = json.loads((tmp_path / "gpu_engine_check.json").read_text())
    assert not report["errors"] and not report["skipped"]
    fp32, wint8 = report["formats"]["fp32"], report["formats"]["wint8"]
    assert fp32["forced"]["max_abs_err_rel"] < 1e-4 and fp32["forced"]["top1_agreement"] == 1.0
    assert wint8["forced"]["max_abs_err_rel"] < 0.1 and wint8["weight_bytes"] < fp32["weight_bytes"]
    assert [d["batch"] for d in fp32["decode"]] == [1, 2] and all(d["tok_s"] > 0 for d in fp32["decode"])
    assert fp32["sampled_decode"]["sampled"] and fp32["sampled_decode"]["tok_s"] > 0
    modeled = report["simulated"]["wint8"]  # the simulated device's step model for the same steps, beside them
    assert sorted(modeled["decode_steps"]) == ["1", "2"] and modeled["decode_steps"]["2"]["seconds"] > 0
    paddle_check = json.loads((tmp_path / "gpu_paddle_check.json").read_text())
    assert not paddle_check["errors"] and paddle_check["forced"]["top1_agreement"] == 1.0
    assert paddle_check["forced"]["max_abs_err_rel"] < 1e-4 and [d["batch"] for d in paddle_check["decode"]] == [1, 2]
