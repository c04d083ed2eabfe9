"""Prefill/decode disaggregation in one process: a PrefillFront and a DecodeFront over real engines,
talking the real pyzmq protocol on loopback; the real two-server setup is tests/e2e/test_disaggregation.py."""
from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.async_engine import AsyncEngine, RequestFailedError
from ernie_serve.serving import disagg
from ernie_serve.ports import refusing_socket, start_on_free_ports
from ernie_serve.sampling_params import SamplingParams

ENGINE = dict(max_model_len=256, block_size=16, max_num_seqs=8, num_gpu_blocks_override=64, disable_progress_bar=True)
PROMPTS = [np.random.default_rng(i).integers(3, 4000, size=n).tolist() for i, n in enumerate((1, 16, 17, 40))]


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    base = dict(ENGINE, model=str(tiny_model_dir))
    # ports of its own: picked, and picked again if a stranger took one before the front bound it (ports.py)
    prefill = start_on_free_ports(lambda port: disagg.engine_front(EngineConfig(**base, splitwise_role="prefill",
                                                                                engine_worker_queue_port=port)))
    decode = disagg.engine_front(EngineConfig(**base, splitwise_role="decode",
                                              innode_prefill_ports=str(prefill.service.port)))
    mixed = AsyncEngine(EngineConfig(**base))
    yield prefill, decode, mixed
    for front in (decode, prefill, mixed):
        front.shutdown(drain=False)


def _collect(front, rid: str, prompt: list[int], params: SamplingParams):
    """Submit; returns a queue of (output, error) and an event set on the final one."""
    q: queue.Queue = queue.Queue()
    front.add_request(rid, prompt, params, lambda out, err: q.put((out, err)))
    return q


def _final(q: queue.Queue, timeout: float = 120):
    while True:
        out, err = q.get(timeout=timeout)
        if out.finished or err is not None:
            return out, err


def _all_free(front) -> bool:
    s = front.stats()
    return s["num_free_blocks"] == s["num_total_blocks"] and not s["num_running"] and not s["num_waiting"]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12),
                                    SamplingParams(temperature=0.8, seed=3, max_tokens=9, repetition_penalty=1.3,
                                                   logprobs=2)],
                         ids=["greedy", "seeded", "penalties_logprobs"])
def test_one_prefill_one_decode_gives_the_tokens_of_one_mixed_server(servers, params):
    prefill, decode, mixed = servers
    runs = {name: [_collect(front, f"{name}-{i}-{params.seed}", p, params) for i, p in enumerate(PROMPTS)]
            for name, front in (("pd", decode), ("mixed", mixed))}
    finals = {name: [_final(q) for q in qs] for name, qs in runs.items()}
    for (pd, pd_err), (mx, mx_err) in zip(finals["pd"], finals["mixed"]):
        assert pd_err is None and mx_err is None
        assert pd.outputs[0].token_ids == mx.outputs[0].token_ids
        assert pd.outputs[0].finish_reason == mx.outputs[0].finish_reason
        if params.logprobs:
            assert [sorted(d) for d in pd.outputs[0].logprobs] == [sorted(d) for d in mx.outputs[0].logprobs]
    for front in (prefill, decode):
        _wait_for(lambda: _all_free(front))


def test_with_a_cache_queue_port_the_kv_travels_on_its_own_connection_and_gives_the_same_tokens(tiny_model_dir,
                                                                                                servers):
    _, _, mixed = servers
    base = dict(ENGINE, model=str(tiny_model_dir))
    prefill = start_on_free_ports(lambda port, kv_port: disagg.engine_front(EngineConfig(
        **base, splitwise_role="prefill", engine_worker_queue_port=port, cache_queue_port=kv_port)), 2)
    decode = disagg.engine_front(EngineConfig(**base, splitwise_role="decode",
                                              innode_prefill_ports=str(prefill.service.port)))
    try:
        _wait_for(lambda: prefill.service._kv_routes)  # the hello on both connections is through
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
        pd = [_final(_collect(decode, f"kvport-{i}", p, params)) for i, p in enumerate(PROMPTS)]
        mx = [_final(_collect(mixed, f"kvport-mixed-{i}", p, params)) for i, p in enumerate(PROMPTS)]
        for (a, a_err), (b, b_err) in zip(pd, mx):
            assert a_err is None and b_err is None
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert prefill.service.transfers == {"prompt_socket": 0, "kv_socket": len(PROMPTS)}
        for front in (prefill, decode):
            _wait_for(lambda: _all_free(front))
    finally:
        for front in (decode, prefill):
            front.shutdown(drain=False)


@pytest.mark.parametrize("own", [("queue", "kv"), ("queue",)], ids=["queue_and_kv_ports", "queue_port_only"])
def test_a_decode_server_with_its_own_queue_ports_gets_its_results_there_and_the_same_tokens(tiny_model_dir, servers,
                                                                                            own):
    """The seeds' decode side names its own --engine-worker-queue-port and --cache-queue-port (FastDeploy's
    instances each have their own): the prefill server sends the KV to the decode server's KV port (or, without
    one, to its queue port), not back on the prompt connection nor from its own KV port."""
    _, _, mixed = servers
    base = dict(ENGINE, model=str(tiny_model_dir))
    prefill = start_on_free_ports(lambda port, kv_port: disagg.engine_front(EngineConfig(
        **base, splitwise_role="prefill", engine_worker_queue_port=port, cache_queue_port=kv_port)), 2)
    decode = start_on_free_ports(lambda own_queue, own_kv: disagg.engine_front(EngineConfig(
        **base, splitwise_role="decode", innode_prefill_ports=str(prefill.service.port),
        engine_worker_queue_port=own_queue, cache_queue_port=own_kv if "kv" in own else None)), 2)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        pd = [_final(_collect(decode, f"own-{i}", p, params)) for i, p in enumerate(PROMPTS)]
        mx = [_final(_collect(mixed, f"own-mixed-{i}", p, params)) for i, p in enumerate(PROMPTS)]
        for (a, a_err), (b, b_err) in zip(pd, mx):
            assert a_err is None and b_err is None
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        where = "decode_kv_socket" if "kv" in own else "decode_queue_socket"
        assert prefill.service.transfers == {"prompt_socket": 0, "kv_socket": 0, where: len(PROMPTS)}
        assert not prefill.service._kv_routes  # it never connected to the prefill server's KV port
        for front in (prefill, decode):
            _wait_for(lambda: _all_free(front))
    finally:
        for front in (decode, prefill):
            front.shutdown(drain=False)


def test_a_decode_server_gets_its_kv_on_the_prompt_connection_until_the_kv_one_is_up(servers):
    prefill, decode, _ = servers  # a prefill server without --cache-queue-port: its hello names no KV port
    out, err = _final(_collect(decode, "no-kv-port", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3)))
    assert err is None and len(out.outputs[0].token_ids) == 3
    assert prefill.service.transfers["kv_socket"] == 0 and prefill.service.transfers["prompt_socket"] > 0
    assert all(server.kv_sock is None for server in decode._servers)


def _wait_for(predicate, rounds: int = 400) -> None:
    ev = threading.Event()
    for _ in range(rounds):
        if predicate():
            return
        ev.wait(0.05)
    raise AssertionError("condition not reached")


def test_cancel_mid_stream_frees_the_blocks_on_both_servers(servers):
    prefill, decode, _ = servers
    streamed = threading.Event()
    got: queue.Queue = queue.Queue()

    def on_output(out, err):
        got.put((out, err))
        if out.outputs[0].token_ids:
            streamed.set()

    decode.add_request("cancel-mid", PROMPTS[3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                       on_output)
    assert streamed.wait(60)
    assert decode.abort("cancel-mid")
    out, err = _final(got)
    assert out.outputs[0].finish_reason == "abort" and err is None
    _wait_for(lambda: _all_free(decode))
    _wait_for(lambda: _all_free(prefill))


def test_cancel_while_the_prompt_is_at_the_prefill_server_reaches_it(servers):
    prefill, decode, _ = servers
    held, release = threading.Event(), threading.Event()

    def hold(stats):  # the prefill server's loop waits here after its next step
        if not release.is_set():
            held.set()
            release.wait(30)

    prefill.step_listeners.append(hold)
    try:
        q = _collect(decode, "cancel-early", PROMPTS[3], SamplingParams(temperature=0, max_tokens=50))
        assert held.wait(60)
        assert decode.abort("cancel-early")
        out, err = _final(q)  # at once, on the decode side
        assert out.outputs[0].finish_reason == "abort" and err is None
    finally:
        release.set()
        prefill.step_listeners.remove(hold)
    _wait_for(lambda: _all_free(prefill))
    _wait_for(lambda: _all_free(decode))


def test_a_request_sent_to_the_prefill_server_directly_is_refused_saying_where_to_send_it(servers):
    prefill, _, _ = servers
    with pytest.raises(ValueError, match="this is a prefill server.*send requests to a decode server"):
        prefill.add_request("direct", [5, 6], SamplingParams(max_tokens=2), lambda out, err: None)


def test_a_dead_prefill_server_fails_its_requests_with_an_error_naming_it(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(disagg, "PREFILL_TIMEOUT_SECONDS", 1.0)
    nobody = refusing_socket()  # held, never listening: nothing can answer on its port
    port = nobody.getsockname()[1]
    decode = disagg.engine_front(EngineConfig(**ENGINE, model=str(tiny_model_dir), splitwise_role="decode",
                                              innode_prefill_ports=str(port)))
    try:
        out, err = _final(_collect(decode, "orphan", [5, 6, 7], SamplingParams(max_tokens=4)), timeout=60)
        assert isinstance(err, RequestFailedError) and out.outputs[0].finish_reason == "error"
        assert f"prefill server 127.0.0.1:{port} has not answered" in str(err)
        assert decode.is_healthy  # the decode engine itself serves on
    finally:
        decode.shutdown(drain=False)
        nobody.close()


def test_a_transfer_that_does_not_fit_the_decode_cache_is_refused_naming_why(servers):
    from ernie_serve.engine.kv_transfer import KVTransfer
    from ernie_serve.kv_blocks import KVBlocks

    _, decode, _ = servers
    cache = decode.engine.engine.runner.cache
    wrong = np.zeros((cache.num_layers + 1, 2, 1, 16, cache.num_kv_heads, cache.head_dim), np.float32)
    q: queue.Queue = queue.Queue()
    decode.engine.add_prefilled(KVTransfer("misfit", [5] * 17, [], 16, 16, KVBlocks(wrong)), SamplingParams(max_tokens=2),
                                lambda out, err: q.put((out, err)))
    out, err = _final(q)
    assert isinstance(err, RequestFailedError) and "must serve the same model" in str(err)


# ---------------------------------------------------------------- the KV over NIXL (--cache-transfer-protocol rdma)
SMALL = {"architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32, "moe_layer_start_index": 1,
         "tie_word_embeddings": True, "max_position_embeddings": 512}
KV_FORMATS = {"float32": ({}, {}), "bfloat16": ({}, {"dtype": "bfloat16"}),
              "c8": ({"quantization_config": {"kv_cache_quant_type": "int8"}}, {})}


@pytest.fixture(scope="module")
def small_checkpoints(tmp_path_factory):
    from ernie_serve.demo.tiny_model import random_weights
    from ernie_serve.model.checkpoint_writer import write_checkpoint

    out = {}
    for name, extra in (("plain", {}), ("c8", KV_FORMATS["c8"][0])):
        out[name] = tmp_path_factory.mktemp(name)
        write_checkpoint(out[name], dict(SMALL, **extra), random_weights(SMALL, seed=3))
    return out


@pytest.mark.parametrize("fmt", list(KV_FORMATS))
def test_over_nixl_every_kv_format_gives_the_tokens_of_the_tcp_path(small_checkpoints, fmt):
    """One prefill server taking both transports (--cache-transfer-protocol rdma,tcp) and two decode servers, one
    on each: the NIXL one reads each prompt's KV in the cache's own format (float32, bfloat16, C8 codes and scales)
    and decodes the very tokens the TCP one does; the prefill server lets every registered export go."""
    base = dict(ENGINE, model=str(small_checkpoints["c8" if fmt == "c8" else "plain"]), skip_tokenizer_init=True,
                **KV_FORMATS[fmt][1])
    prefill = start_on_free_ports(lambda port: disagg.engine_front(EngineConfig(
        **base, splitwise_role="prefill", engine_worker_queue_port=port, cache_transfer_protocol="rdma,tcp")))
    port = prefill.service.port
    decodes = {name: disagg.engine_front(EngineConfig(**base, splitwise_role="decode", innode_prefill_ports=str(port),
                                                      cache_transfer_protocol=name)) for name in ("rdma", "tcp")}
    try:
        cache = decodes["rdma"].engine.engine.runner.cache
        assert cache.export_blocks([0]).dtype == {"float32": "float32", "bfloat16": "bfloat16", "c8": "int8"}[fmt]
        prompts = [[3 + t % 250 for t in p] for p in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        got = {name: [_final(_collect(front, f"{fmt}-{name}-{i}", p, params)) for i, p in enumerate(prompts)]
               for name, front in decodes.items()}
        for (a, a_err), (b, b_err) in zip(got["rdma"], got["tcp"]):
            assert a_err is None and b_err is None
            assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 8
        assert prefill.service.by_transport == {"nixl": len(prompts), "tcp": len(prompts)}
        assert decodes["rdma"].received["nixl"] == len(prompts) and decodes["tcp"].received == {"tcp": len(prompts)}
        _wait_for(lambda: prefill.service._senders["nixl"].held_bytes == 0)  # every kv_done came back
        for front in (prefill, *decodes.values()):
            _wait_for(lambda: _all_free(front))
    finally:
        for front in (*decodes.values(), prefill):
            front.shutdown(drain=False)


def test_a_decode_server_sharing_no_transport_with_its_prefill_server_fails_requests_naming_the_flag(
        tiny_model_dir, servers):
    prefill, _, _ = servers  # takes tcp only (the default)
    decode = disagg.engine_front(EngineConfig(**ENGINE, model=str(tiny_model_dir), splitwise_role="decode",
                                              innode_prefill_ports=str(prefill.service.port),
                                              cache_transfer_protocol="rdma"))
    try:
        out, err = _final(_collect(decode, "no-common-transport", PROMPTS[1], SamplingParams(max_tokens=3)), 60)
        assert isinstance(err, RequestFailedError) and out.outputs[0].finish_reason == "error"
        assert "sends KV over tcp and this decode server takes nixl" in str(err)
        assert "--cache-transfer-protocol" in str(err)
        assert decode.is_healthy
    finally:
        decode.shutdown(drain=False)
