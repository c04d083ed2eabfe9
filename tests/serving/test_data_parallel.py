"""--data-parallel-size N: N ernie_moe instances (one engine each), wired through the launcher."""
from __future__ import annotations

import pytest

from ernie_serve.cli.serve import build_parser, main, settings_from_args
from ernie_serve.serving.launcher import TritonServer, replicas


def test_data_parallel_size_becomes_the_engine_instance_count_and_leaves_the_engine_settings(tmp_path):
    server = TritonServer({"data_parallel_size": "3", "max_model_len": "512"}, run_dir=tmp_path)
    assert server.engine_instances == 3
    assert "data_parallel_size" not in server.settings  # each engine is one replica: it never sees the flag


def test_the_cli_accepts_data_parallel_size_though_one_engine_refuses_it():
    settings = settings_from_args(build_parser().parse_args(["--data-parallel-size", "2"]))
    assert replicas(settings, None) == 2 and "data_parallel_size" not in settings


@pytest.mark.parametrize("settings,instances,message", [
    ({"data_parallel_size": "2"}, 3, "disagree"),
    ({"data_parallel_size": "0"}, None, "must be >= 1"),
    ({"data_parallel_size": "2", "splitwise_role": "prefill"}, None, "one prefill server per port"),
    ({"data_parallel_size": "2", "splitwise_role": "decode", "innode_prefill_ports": "8182",
      "cache_queue_port": "8187"}, None, "one decode server per port"),
])
def test_replica_counts_that_cannot_work_are_refused(settings, instances, message):
    with pytest.raises(ValueError, match=message):
        replicas(dict(settings), instances)


def test_the_cli_refuses_them_before_starting_anything(capsys):
    assert main(["--data-parallel-size", "2", "--engine-instances", "3"]) == 2
    assert "disagree" in capsys.readouterr().err
