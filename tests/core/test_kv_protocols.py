"""--cache-transfer-protocol (kv_protocols.py, EngineConfig.cache_transfer_protocol): FastDeploy's values mapped onto
the transports, and what cannot run refused at start-up naming the flag."""
from __future__ import annotations

import pytest

from ernie_serve import kv_protocols
from ernie_serve.config import EngineConfig


@pytest.mark.parametrize("value,want", [(None, ["tcp"]), ("tcp", ["tcp"]), ("rdma", ["nixl"]), ("ipc", ["nixl"]),
                                        ("rdma,ipc", ["nixl"]), (" RDMA , tcp", ["nixl", "tcp"]),
                                        ("tcp,nixl", ["tcp", "nixl"])])
def test_fastdeploys_protocols_map_onto_the_transports_in_their_order(value, want):
    assert kv_protocols.transports(value) == want


@pytest.mark.parametrize("value", ["rdma,mooncake", "", " , "])
def test_an_unknown_protocol_is_refused_naming_the_flag_and_the_known_ones(value):
    with pytest.raises(ValueError, match=r"cache_transfer_protocol \(--cache-transfer-protocol\).*known: tcp, rdma"):
        kv_protocols.transports(value or ",")


def test_the_config_takes_the_flag_on_prefill_and_decode_servers_and_refuses_it_on_a_mixed_one():
    EngineConfig(splitwise_role="prefill", engine_worker_queue_port=8182, cache_transfer_protocol="rdma,ipc")
    EngineConfig(splitwise_role="decode", innode_prefill_ports="8182", cache_transfer_protocol="tcp")
    with pytest.raises(ValueError, match="cache_transfer_protocol='rdma' is how a prefill server's KV"):
        EngineConfig(cache_transfer_protocol="rdma")
    with pytest.raises(ValueError, match="--cache-transfer-protocol"):
        EngineConfig(splitwise_role="prefill", engine_worker_queue_port=8182, cache_transfer_protocol="shm")


def test_without_a_nixl_build_rdma_is_refused_at_start_up_naming_the_flag_and_the_fallback(monkeypatch):
    monkeypatch.setattr(kv_protocols, "NIXL_MODULES", ("ernie_no_such_nixl._api",))
    monkeypatch.setattr(kv_protocols, "_nixl", None)
    with pytest.raises(ValueError, match=r"selects NIXL.*no NIXL build imports.*pip install nixl-cu12.*"
                                         r"--cache-transfer-protocol tcp"):
        EngineConfig(splitwise_role="prefill", engine_worker_queue_port=8182, cache_transfer_protocol="rdma")
    EngineConfig(splitwise_role="prefill", engine_worker_queue_port=8182, cache_transfer_protocol="tcp")


def test_nixl_imports_from_the_build_installed_by_setup():
    api = kv_protocols.nixl_api()
    assert hasattr(api, "nixl_agent") and hasattr(api, "nixl_agent_config")
