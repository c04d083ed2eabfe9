"""The bounded soak (scripts/soak.py) for CI: 45 s of mixed shim and gRPC streams with random cancels and
bad requests against a real tritonserver; nothing lost, KV whole when idle, RSS flat (issue 16 "soak").
The 10-minute run: docs/reliability.md; its figures: benchmarks/results/readme_soak.json."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_soak_of_mixed_traffic_loses_nothing_and_leaks_nothing(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--duration", "45", "--checkpoint", "15",
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    said = run.stdout[-3000:] + run.stderr[-6000:]  # the server's log tail, when it failed
    assert out.exists(), said
    result = json.loads(out.read_text())
    assert result["by_outcome"].get("lost", 0) == 0 and result["by_outcome"].get("unexpected", 0) == 0, \
        (result["first_failures"], said)
    assert result["by_outcome"].get("cancelled", 0) > 0 and result["by_outcome"].get("refused", 0) > 0
    assert result["kv_whole_when_idle"], result["checkpoints"]
    assert result["passed"], (result["failures"], said)
    assert run.returncode == 0
