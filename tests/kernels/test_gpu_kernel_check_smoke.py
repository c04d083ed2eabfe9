"""scripts/gpu_kernel_check.py's correctness part runs (tiny shapes, interpreter) and writes its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_kernel_check_cpu_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_kernel_check.py"), "--cpu-smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_kernel_check.json").read_text())
    assert report["all_correct"] and len(report["results"]) == 13
