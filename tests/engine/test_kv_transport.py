"""The KV transports (engine/kv_transport.py, kv_transport_nixl.py): every KV format a cache holds crosses each of them
bit for bit through the one interface the prefill/decode servers drive; NIXL reads registered memory and lets it go
when told. Two NIXL agents in one process talk through UCX as two processes' would."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from ernie_serve.engine import kv_transport_nixl
from ernie_serve.engine.kv_transfer import KVTransfer
from ernie_serve.engine.kv_transport import Received, make_receiver, make_sender, negotiate
from ernie_serve.model.kv_cache import KVCacheQuant, PagedKVCache

LAYERS, BLOCKS, BLOCK, HEADS, HD = 2, 6, 4, 2, 8
FORMATS = ["float32", "bfloat16", "int8-static", "int8-dynamic"]


def _exported(fmt: str, ids: list[int]):
    """Blocks as a cache of this format exports them (export_blocks: codes as stored, scales with them)."""
    rng = np.random.default_rng(len(fmt))
    quant = None
    if fmt == "int8-static":
        quant = KVCacheQuant(*[[rng.uniform(1, 3, HEADS * HD).astype(np.float32) for _ in range(LAYERS)]
                               for _ in range(2)])
    elif fmt == "int8-dynamic":
        quant = KVCacheQuant()
    dtype = "bfloat16" if fmt == "bfloat16" else "float32"
    cache = PagedKVCache(LAYERS, BLOCKS, BLOCK, HEADS, HD, quant, dtype=dtype)
    cache.write_blocks(ids, rng.standard_normal((LAYERS, 2, len(ids), BLOCK, HEADS, HD)).astype(np.float32))
    return cache.export_blocks(ids)


@pytest.fixture(scope="module")
def nixl_pair():
    sender, receiver = make_sender("nixl", "test"), make_receiver("nixl", "test")
    receiver.connect(sender.hello())
    yield sender, receiver
    receiver.close()
    sender.close()


def _pair(transport: str, nixl_pair):
    return nixl_pair if transport == "nixl" else (make_sender("tcp", "t"), make_receiver("tcp", "t"))


def _received(receiver, sender, rounds: int = 2000) -> Received:
    """Poll as the decode server's socket thread does, the sender's side moved along as the prefill server's is."""
    ev = threading.Event()
    for _ in range(rounds):
        sender.progress()
        done = receiver.poll()
        if done:
            (got,) = done
            return got
        ev.wait(0.005)
    raise AssertionError("the receive did not end")


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_kv_format_crosses_each_transport_bit_for_bit(nixl_pair, transport, fmt):
    sender, receiver = _pair(transport, nixl_pair)
    blocks = _exported(fmt, [4, 1, 3])
    transfer = KVTransfer(f"{transport}-{fmt}", [7, 8, 9, 10], [11], 4, BLOCK, blocks)
    frames = [bytes(f) for f in sender.offer(transfer)]
    if transport == "nixl":  # only where to read them travels in the message: one JSON frame
        (msg,) = frames
        assert [n for _, n in json.loads(msg)["buffers"]] == [a.nbytes for a in blocks.arrays()]
    assert receiver.receive(frames) == transfer.request_id
    got = _received(receiver, sender)
    assert got.error is None and got.nbytes == blocks.nbytes
    back = got.transfer
    assert (back.request_id, back.prompt_token_ids, back.output_token_ids, back.num_computed_tokens) == \
           (transfer.request_id, [7, 8, 9, 10], [11], 4)
    assert back.blocks.dtype == blocks.dtype and back.blocks.scale_kind == blocks.scale_kind
    np.testing.assert_array_equal(back.blocks.codes.view(np.uint8), blocks.codes.view(np.uint8))
    if blocks.scales is not None:
        np.testing.assert_array_equal(back.blocks.scales, blocks.scales)
    sender.release(transfer.request_id)


def test_nixl_holds_the_offered_blocks_registered_until_the_decode_side_is_done(nixl_pair):
    sender, receiver = nixl_pair
    blocks = _exported("int8-dynamic", [0, 2])
    frames = sender.offer(KVTransfer("held", [1, 2, 3], [], 3, BLOCK, blocks))
    assert sender.held_bytes == blocks.nbytes
    receiver.receive(frames)
    assert _received(receiver, sender).error is None
    assert sender.held_bytes == blocks.nbytes  # until kv_done says so
    sender.release("held")
    assert sender.held_bytes == 0


def test_nixl_lets_go_of_an_offer_nobody_read_after_its_time(nixl_pair, monkeypatch):
    sender, _ = nixl_pair
    sender.offer(KVTransfer("orphan", [1, 2], [], 2, BLOCK, _exported("float32", [5])))
    import time
    assert sender.expire(time.monotonic()) == []
    monkeypatch.setattr(kv_transport_nixl, "HOLD_SECONDS", 0.0)
    assert sender.expire(time.monotonic() + 1) == ["orphan"] and sender.held_bytes == 0


def test_blocks_that_do_not_match_their_header_fail_the_receive_naming_the_sender(nixl_pair):
    sender, receiver = nixl_pair
    frames = sender.offer(KVTransfer("bad-header", [1, 2], [], 2, BLOCK, _exported("float32", [1])))
    msg = json.loads(frames[0])
    msg["transfer"]["kv"]["shape"][2] += 1  # one block more than the bytes hold
    receiver.receive([json.dumps(msg).encode()])
    got = _received(receiver, sender)
    assert got.transfer is None and sender.agent.name in got.error and "reshape" in got.error
    sender.release("bad-header")


def test_the_sender_picks_its_first_transport_the_receiver_takes():
    assert negotiate(["nixl", "tcp"], ["tcp", "nixl"]) == "nixl"
    assert negotiate(["tcp", "nixl"], ["nixl", "tcp"]) == "tcp"
    assert negotiate(["nixl"], ["tcp"]) is None
