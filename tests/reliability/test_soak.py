"""The bounded soak (scripts/soak.py) for CI: 45 s of mixed shim and gRPC streams with random cancels and
bad requests against a real tritonserver; nothing lost, KV whole when idle, RSS flat (issue 16 "soak").
The 10-minute run: docs/reliability.md; its figures: benchmarks/results/readme_soak.json. The 256-stream run on the
simulated target (issue 48): benchmarks/results/soak_simulated_256.json; its flags are checked here without a server."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import soak  # noqa: E402


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
    assert sum(result["checkpoints"][-1]["done"].values()) == result["requests"]


def test_simulated_target_sizes_the_server_to_the_clients():
    args = soak.parse_args(["--simulated-gpu", "h200", "--simulated-model", "ernie-4.5-21b-a3b",
                            "--quantization", "wint8", "--clients", "256", "--max-rss-growth-pct", "5"])
    settings = soak.server_settings(args)
    assert settings["execution_backend"] == "simulated" and settings["quantization"] == "wint8"
    assert int(settings["max_num_seqs"]) == 256
    assert int(settings["max_model_len"]) >= soak.PROMPT_BUDGET + soak.SIMULATED_TRAFFIC.max_tokens
    assert settings["reasoning_parser"] and settings["tool_call_parser"]
    assert "num_gpu_blocks_override" not in settings  # the pool is the target GPU's
    assert args.max_rss_growth_mb is None  # only the per-process limit asked for
    assert soak.server_settings(soak.parse_args([])) == soak.TINY_SETTINGS
    assert soak.parse_args([]).max_rss_growth_mb == 150.0


@pytest.mark.parametrize("argv, field", [(["--simulated-gpu", "h200"], "--simulated-model"),
                                         (["--quantization", "wint8"], "--quantization"),
                                         (["--max-rss-growth-pct", "-1"], "--max-rss-growth-pct")])
def test_bad_flags_are_refused_naming_the_flag(argv, field, capsys):
    with pytest.raises(SystemExit):
        soak.parse_args(argv)
    assert field in capsys.readouterr().err


def test_rss_growth_pct_is_per_process_from_the_first_loaded_checkpoint():
    def point(at, shim, moe):
        return soak.Checkpoint(at, {"shim": shim, "ernie_moe_0_0": moe}, 10, 10)

    points = [point(0, 50.0, 300.0), point(60, 100.0, 400.0), point(120, 106.0, 404.0)]
    mb, pct = soak.rss_growth(points)
    assert mb == {"shim": 6.0, "ernie_moe_0_0": 4.0} and pct == {"shim": 6.0, "ernie_moe_0_0": 1.0}
    args = soak.parse_args(["--max-rss-growth-pct", "5"])
    result = soak.summarize(args, soak.Tally(), points, alive=True)
    assert result["failures"] == ["RSS grew over 5.0%: shim +6.0%"]
    args = soak.parse_args(["--max-rss-growth-pct", "5", "--max-rss-growth-mb", "5"])
    assert len(soak.summarize(args, soak.Tally(), points, alive=True)["failures"]) == 2
