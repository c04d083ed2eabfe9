"""The CPU GEMMs (cpu_gemm.c float32 / bfloat16, cpu_qgemm.c int8 / int4) against the dequantized reference, and
QuantLinear's use of them. The kernel tests take the `isa` fixture (conftest.py): each runs on every instruction-set
tier this CPU has, the float64 / NumPy reference the same for all."""
from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import paddle
import pytest

from ernie_serve.cpu_kernels import build, cpu_gemm
from ernie_serve.devices import cpu_flags_line
from ernie_serve.quantization import formats as fmt
from ernie_serve.model.quantized_layers import QuantLinear

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler to build cpu_gemm.c")
# cpu_qgemm.c's tiers whose int8 / int4 codes meet float activations as they are (the widening blocks: AVX2 + FMA
# without AVX-512 VNNI); the others quantize the activations to two int8 levels
WIDENING = [t for t in build.isas() if t in ("avx2", "avx512")]
AMX = [t for t in build.isas() if t == "amx"]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (3, 64, 96), (8, 128, 40), (9, 256, 64), (16, 1024, 1408),
                                   (17, 32, 33), (32, 96, 7), (5, 58, 65), (70, 136, 64)])
def test_matches_the_dequantized_matmul(isa, bits, m, k, n):
    """Activations enter cpu_qgemm.c at 16-bit precision (two int8 levels a row): within max|x| / 64516 an
    element, so the product is within ~1e-4 of its row's scale; K not a multiple of the 4 / 8-row groups too."""
    rng = np.random.default_rng(m * 1000 + n + bits)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0] *= 1000.0  # rows are scaled one by one
    q, s = fmt.quantize_weight_only(w, bits)
    ref = x @ fmt.dequantize_weight_only(q, s, bits)
    got = cpu_gemm.gemm(x, cpu_gemm.packed_codes(q, bits), n, paddle.to_tensor(s), bits).numpy()
    row_scale = np.abs(ref).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - ref) <= 1e-4 * row_scale)


@pytest.mark.parametrize("isa", WIDENING, indirect=True)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (4, 70, 96), (5, 1024, 1408), (9, 14, 33), (66, 136, 64)])
def test_without_vnni_the_codes_are_widened_and_x_enters_as_it_is(isa, bits, m, k, n):
    """On AVX2 + FMA without AVX-512 VNNI (a Zen 3; a newer CPU capped at avx2 or avx512) float activations are not
    quantized: the product is the float32 one of the dequantized weight (to float32 rounding, well inside the 16-bit
    activation path's bound above), for one GEMM and the batched experts, K not a multiple of a group too (the
    SwiGLU-fused form: test_swiglu_fused_... below)."""
    rng = np.random.default_rng(m * 7 + k + bits)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    q, s = fmt.quantize_weight_only(w, bits)
    deq = fmt.dequantize_weight_only(q, s, bits).astype(np.float64)
    codes, scale = cpu_gemm.packed_codes(q, bits), paddle.to_tensor(s)
    ref = x.astype(np.float64) @ deq
    np.testing.assert_allclose(cpu_gemm.gemm(x, codes, n, scale, bits).numpy(), ref, rtol=1e-5, atol=1e-4)
    both = cpu_gemm.moe_gemm(np.stack([x, x[::-1]]), np.array([m, m]), [codes, codes], n, [scale, scale], bits).numpy()
    np.testing.assert_allclose(both[1], x[::-1].astype(np.float64) @ deq, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_integer_valued_activations_are_exact(isa, bits):
    """w4a8's activations are int8 already (int_x): one exact level, so the product is the integer one."""
    rng = np.random.default_rng(bits)
    q, s = fmt.quantize_weight_only(rng.standard_normal((64, 48)).astype(np.float32), bits)
    x = rng.integers(-127, 128, (6, 64)).astype(np.float32)
    codes = fmt.unpack_int4(q) if bits == 4 else q
    want = (x.astype(np.int64) @ codes.astype(np.int64)).astype(np.float32) * s
    got = cpu_gemm.gemm(x, cpu_gemm.packed_codes(q, bits), 48, paddle.to_tensor(s), bits, int_x=True).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_zero_rows_give_zeros_and_non_finite_rows_do_not_pass_as_numbers(isa):
    q, s = fmt.quantize_weight_only(np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32), 8)
    x = np.zeros((3, 32), np.float32)
    x[1, 3], x[2, 5] = np.inf, np.nan
    got = cpu_gemm.gemm(x, cpu_gemm.packed_codes(q, 8), 32, paddle.to_tensor(s), 8).numpy()
    assert np.all(got[0] == 0) and not np.isfinite(got[1:]).any()  # NaN (integer path) or the inf itself (widening)


@pytest.mark.parametrize("method", ["wint8", "wint4", "w4a8"])
def test_quant_linear_gives_the_same_result_on_both_paths(isa, method, monkeypatch):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 160)).astype(np.float32)
    x = paddle.to_tensor(rng.standard_normal((5, 256)).astype(np.float32))
    layer = QuantLinear.from_float(w, method, calib_x=rng.standard_normal((64, 256)).astype(np.float32)
                                   if method == "w4a8" else None)
    fast = layer(x).numpy()
    monkeypatch.setattr(cpu_gemm, "serves", lambda t: False)  # the dequantized-tile path
    slow = layer(x).numpy()
    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-4 * np.abs(slow).max())


@pytest.mark.parametrize("n", [1, 31, 32, 33, 100])
def test_the_column_blocked_layout_round_trips_every_column_range(n):
    q = np.random.default_rng(n).integers(-128, 128, (6, n), dtype=np.int8)
    blocked = cpu_gemm.pack_columns(q)
    assert blocked.shape == (-(-n // 32), 6, 32)
    for n0, n1 in [(0, n), (0, 1), (n - 1, n), (min(32, n - 1), n)]:
        np.testing.assert_array_equal(cpu_gemm.unpack_columns(blocked, n0, n1), q[:, n0:n1])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k,n", [(8, 1), (12, 31), (64, 32), (72, 33), (30, 100)])
def test_the_integer_layout_round_trips_every_column_range(bits, k, n):
    codes = np.random.default_rng(k + n).integers(-8 if bits == 4 else -128, 8 if bits == 4 else 128, (k, n),
                                                  dtype=np.int8)
    q = fmt.pack_int4(codes) if bits == 4 else codes
    blocked = cpu_gemm.pack_codes(q, bits)
    assert blocked.shape == cpu_gemm.codes_shape(k, n, bits) and blocked.dtype == np.uint8
    for n0, n1 in [(0, n), (0, 1), (n - 1, n), (min(32, n - 1), n)]:
        np.testing.assert_array_equal(cpu_gemm.unpack_codes(blocked, k, bits, n0, n1), q[:, n0:n1])


def test_quant_linear_exports_the_checkpoint_layout_it_was_given():
    w = np.random.default_rng(4).standard_normal((64, 72)).astype(np.float32)
    for method in ("wint8", "wint4"):
        t = fmt.quantize_float(w, method)
        layer = QuantLinear.from_checkpoint(t, method)
        np.testing.assert_array_equal(layer.export()["quant_weight"], t["quant_weight"])
        np.testing.assert_array_equal(layer.dequantize(0, 72).numpy(),
                                      fmt.dequantize_weight_only(t["quant_weight"], t["weight_scale"],
                                                                 8 if method == "wint8" else 4))


def test_a_shape_mismatch_is_refused():
    q, s = fmt.quantize_weight_only(np.ones((64, 32), np.float32), 8)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_gemm.gemm(np.ones((2, 60), np.float32), cpu_gemm.packed_codes(q, 8), 32, paddle.to_tensor(s), 8)


def test_without_a_compiler_it_is_not_built_and_says_why(tmp_path):
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), ERNIE_BUILD_DIR=str(tmp_path))
    code = ("import logging; logging.basicConfig(); from ernie_serve.cpu_kernels import cpu_gemm; "
            "print('available', cpu_gemm.available())")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "available False" in r.stdout, r.stderr
    assert "CPU kernels not built" in r.stderr


@pytest.mark.parametrize("method", ["wint8", "wint4", "w4a8"])
@pytest.mark.parametrize("offset", [None, 4])
def test_quantized_experts_batched_in_one_call_equal_the_per_expert_path(isa, method, offset):
    """Every routed expert runs in one cpu_qgemm.c call per matrix (QuantMoEExperts.packed_forward); it must give the
    per-expert loop's result exactly (the same rows quantize the same way), under expert parallelism too."""
    from ernie_serve.model.quantized_layers import QuantMoEExperts

    rng = np.random.default_rng(7)
    num, h, inter, t, k = 8, 128, 96, 12, 2
    ug = (rng.standard_normal((num, h, 2 * inter)) * 0.1).astype(np.float32)
    dn = (rng.standard_normal((num, inter, h)) * 0.1).astype(np.float32)
    x = paddle.to_tensor(rng.standard_normal((t, h)).astype(np.float32))
    ids = paddle.to_tensor(rng.integers(0, num, (t, k)))
    w = paddle.to_tensor(rng.random((t, k)).astype(np.float32))
    local = slice(4, 8) if offset else slice(None)
    experts = QuantMoEExperts.from_float(ug[local], dn[local], method, calib_x=x.numpy())
    assert experts.can_batch(np.array([3, 1, 0, 5]))
    batched = experts(x, ids, w, offset).numpy()
    experts.can_batch = lambda counts: False
    np.testing.assert_array_equal(batched, experts(x, ids, w, offset).numpy())


def test_the_batched_expert_call_refuses_rows_that_do_not_fit():
    q, s = fmt.quantize_weight_only(np.ones((64, 32), np.float32), 8)
    blocked, scale = cpu_gemm.packed_codes(q, 8), paddle.to_tensor(s)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_gemm.moe_gemm(np.ones((2, 3, 64), np.float32), np.array([1, 4]), [blocked, blocked], 32, [scale, scale], 8)


def _bf16(a: np.ndarray) -> np.ndarray:
    """a rounded to bfloat16, back in float32: what a bfloat16 weight holds."""
    return np.asarray(a, ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (3, 64, 96), (8, 128, 40), (9, 256, 64), (17, 32, 33),
                                   (32, 96, 7), (70, 136, 64), (40, 256, 96), (33, 1056, 64)])
def test_a_bfloat16_weight_gives_the_float32_product_of_its_rounded_values(isa, m, k, n):
    """bits 16: the weight rounded to bfloat16 once (nearest even), then float32 arithmetic on x: bit for bit the
    float32 kernel's product on the rounded weight, every row count and a last narrow block too. On AMX (from 16 rows,
    K % 32 == 0) x is rounded to bfloat16 as well and the tile unit accumulates in float32: then the float64 product of
    the two rounded operands (panels of 1024 k, row groups of 16 and a partial one included)."""
    rng = np.random.default_rng(m * 31 + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    half = cpu_gemm.packed(w, bits=16)
    assert half.dtype == paddle.int16 and tuple(half.shape) == cpu_gemm.blocked_shape((k, n))
    np.testing.assert_array_equal(cpu_gemm.unpack_columns(np.from_dlpack(half), 0, n), _bf16(w))
    got = cpu_gemm.gemm(x, half, n, None, 16).numpy()
    if cpu_gemm.bf16_on_amx(m, k):
        exact = _bf16(x).astype(np.float64) @ _bf16(w).astype(np.float64)
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    else:
        np.testing.assert_array_equal(got, cpu_gemm.gemm(x, cpu_gemm.packed(_bf16(w)), n, None, 32).numpy())
        np.testing.assert_allclose(got, x @ _bf16(w), rtol=1e-4, atol=1e-4)
    rows = np.array([m, max(1, m // 2)])
    both = cpu_gemm.moe_gemm(np.stack([x, x[::-1]]), rows, [half, half], n, None, 16).numpy()
    np.testing.assert_array_equal(both[0], got)
    idx, best = cpu_gemm.gemm_argmax(x, half, n, n, bits=16)
    assert idx.tolist() == np.argmax(got, axis=1).tolist()
    np.testing.assert_array_equal(best, got.max(axis=1))


def test_bfloat16_runs_on_amx_from_16_rows_where_the_cpu_has_it(isa):
    """AMX takes a bfloat16 GEMM from 16 rows when K is a multiple of 32 (a tile's k); a CPU without AMX-BF16, or
    capped below amx, keeps every bfloat16 GEMM on float32 x."""
    has_amx = isa == "amx" and "amx_bf16" in cpu_flags_line().split()
    assert cpu_gemm.bf16_on_amx(16, 64) == has_amx and cpu_gemm.bf16_on_amx(1000, 1024) == has_amx
    assert not cpu_gemm.bf16_on_amx(15, 64) and not cpu_gemm.bf16_on_amx(16, 72)


@pytest.mark.parametrize("m", [1, 15, 16, 17, 31, 32, 33, 47, 64, 65, 100, 260, 272, 300])
def test_every_row_count_on_the_amx_shapes_gives_the_product_of_the_rounded_operands(isa, m):
    """K a multiple of 32 over two of cpu_amx.c's panels (1056 = 1024 + 32) and a narrow last block: below 16 rows the
    widening tiles' product of float32 x; from 16 (on AMX) the float64 product of bfloat16-rounded x, whatever the row
    groups of 16 and a partial one; the SwiGLU fused pass (gate and up blocks sharing each x tile on AMX, 256 rows at a
    time) matches the plain product either way, its last pass of 4 (260) or 16 rows (272) on the one-group path."""
    from ernie_serve.model.layers import silu_and_mul

    rng = np.random.default_rng(m)
    k = 1056
    x = rng.standard_normal((m, k)).astype(np.float32)
    xs = _bf16(x) if cpu_gemm.bf16_on_amx(m, k) else x
    for n in (70, 100):  # 2 and 3 full blocks (from 64 rows AMX takes them in pairs, then a last one alone)
        w = rng.standard_normal((k, n)).astype(np.float32)
        got = cpu_gemm.gemm(x, cpu_gemm.packed(w, bits=16), n, None, 16).numpy()
        exact = xs.astype(np.float64) @ _bf16(w).astype(np.float64)
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    gate_up = cpu_gemm.packed(w[:, :64], bits=16)
    fused = cpu_gemm.gemm(x, gate_up, 64, None, 16, swiglu=True).numpy()
    np.testing.assert_allclose(fused, silu_and_mul(cpu_gemm.gemm(x, gate_up, 64, None, 16)).numpy(),
                               rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("m", range(1, 22))
def test_every_row_count_gives_the_product_in_both_float_widths(isa, m):
    """cpu_gemm.c picks its register tiles by the row count and width (whole 32-column blocks for float32 up to 16
    rows and bfloat16 up to 2, 16-column halves of up to 6 rows beyond): every count past both cuts, with a narrow
    last block, equals the float64 product, and bfloat16 equals float32 on the rounded weight."""
    rng = np.random.default_rng(m)
    k, n = 75, 70
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = cpu_gemm.gemm(x, cpu_gemm.packed(w), n, None, 32).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-4)
    rounded = cpu_gemm.gemm(x, cpu_gemm.packed(_bf16(w)), n, None, 32).numpy()
    np.testing.assert_array_equal(cpu_gemm.gemm(x, cpu_gemm.packed(w, bits=16), n, None, 16).numpy(), rounded)


def test_a_weight_held_in_another_float_width_is_refused():
    """A float32 weight read as bfloat16 (or the reverse) would be garbage: the shape fits, the dtype does not."""
    w = np.ones((64, 32), np.float32)
    with pytest.raises(ValueError, match="16-bit"):
        cpu_gemm.gemm(np.ones((2, 64), np.float32), cpu_gemm.packed(w), 32, None, 16)
    with pytest.raises(ValueError, match="32-bit"):
        cpu_gemm.gemm_argmax(np.ones((2, 64), np.float32), cpu_gemm.packed(w, bits=16), 32, 32)


@pytest.mark.parametrize("bits", [32, 16, 8, 4])
@pytest.mark.parametrize("m", [1, 5, 8, 19, 53])
def test_swiglu_fused_into_the_gate_up_matmul_equals_silu_after_it(isa, bits, m):
    """gemm / moe_gemm with swiglu=True give silu(gate) * up of the plain product, for every weight format."""
    from ernie_serve.model.layers import silu_and_mul

    rng = np.random.default_rng(m + bits)
    k, inter = 96, 64
    if bits in (32, 16):
        w = rng.standard_normal((k, 2 * inter)).astype(np.float32)
        blocked, scale = cpu_gemm.packed(w, bits), None
    else:
        q, s = fmt.quantize_weight_only(rng.standard_normal((k, 2 * inter)).astype(np.float32), bits)
        blocked, scale = cpu_gemm.packed_codes(q, bits), paddle.to_tensor(s)
    assert cpu_gemm.swiglu_fits(2 * inter) and not cpu_gemm.swiglu_fits(2 * 40)
    x = rng.standard_normal((m, k)).astype(np.float32)
    plain = silu_and_mul(cpu_gemm.gemm(x, blocked, 2 * inter, scale, bits)).numpy()
    fused = cpu_gemm.gemm(x, blocked, 2 * inter, scale, bits, swiglu=True).numpy()
    np.testing.assert_allclose(fused, plain, rtol=2e-6, atol=1e-6)
    xs, rows = np.stack([x, x[::-1]]), np.array([m, max(1, m - 3)])
    scales = None if scale is None else [scale, scale]
    plain_e = silu_and_mul(cpu_gemm.moe_gemm(xs, rows, [blocked, blocked], 2 * inter, scales, bits)).numpy()
    fused_e = cpu_gemm.moe_gemm(xs, rows, [blocked, blocked], 2 * inter, scales, bits, swiglu=True).numpy()
    for e, r in enumerate(rows):
        np.testing.assert_allclose(fused_e[e, :r], plain_e[e, :r], rtol=2e-6, atol=1e-6)


def _task_runs(lib, rows: np.ndarray, nb: int, threads: int, flat_from: int = 0) -> list[tuple[int, int]]:
    import ctypes

    runs = []
    for t in range(threads):
        first, end = ctypes.c_int(), ctypes.c_int()
        lib.ernie_task_run(ctypes.c_void_p(rows.ctypes.data), len(rows), nb, flat_from, t, threads,
                           ctypes.byref(first), ctypes.byref(end))
        runs.append((first.value, end.value))
    return runs


def _task_cost(rows: int, flat_from: int) -> float:
    """threads.c's task_cost in rows: 16 + rows, the rows past flat_from (when set) a quarter each; 0 without rows."""
    if not rows:
        return 0
    return 16 + (rows if not flat_from or rows <= flat_from else flat_from + (rows - flat_from) / 4)


def test_the_threads_task_runs_tile_the_tasks_in_order_at_equal_cost():
    """The MoE GEMMs' threads each take one run of (expert, column block) tasks: the runs cover every task once, in
    task order, and each costs (16 + rows a task with rows, those past flat_from a quarter each, 0 without) the
    total's share to within one task, on random expert counts, row counts (zeros, one expert holding most, none at
    all), thread counts and flat_from (0, or AMX-INT8's 5)."""
    lib, rng = build.library(), np.random.default_rng(0)
    for case in range(500):
        threads, e, nb = int(rng.integers(1, 9)), int(rng.integers(1, 20)), int(rng.integers(1, 12))
        flat_from = 5 if case % 2 else 0
        rows = np.where(rng.random(e) < 0.3, 0, rng.integers(1, 12, e)).astype(np.int64)
        if case % 7 == 0:
            rows[rng.integers(e)] = 800  # a prefill chunk's expert
        if case % 11 == 0:
            rows[:] = 0
        runs = _task_runs(lib, rows, nb, threads, flat_from)
        assert runs[0][0] == 0 and runs[-1][1] == e * nb, (rows, nb, runs)
        for (_, end), (first, _) in zip(runs, runs[1:]):
            assert end == first, runs
        cost = [_task_cost(int(r), flat_from) for r in rows for _ in range(nb)]
        total, most = sum(cost), max(cost)
        for first, end in runs:
            assert first <= end
            assert abs(sum(cost[first:end]) - total / threads) <= most, (rows, nb, threads, runs)


def test_next_task_is_the_next_one_of_the_run_with_rows():
    """The GEMMs prefetch the weights of the task their thread runs next: the next task of its run whose expert has
    rows, or none at the run's end. Checked against the runs laid out in Python."""
    import ctypes

    lib, rng = build.library(), np.random.default_rng(1)
    for _ in range(300):
        threads, e, nb = int(rng.integers(1, 5)), int(rng.integers(1, 7)), int(rng.integers(1, 6))
        rows = np.where(rng.random(e) < 0.4, 0, rng.integers(1, 9, e)).astype(np.int64)
        for first, end in _task_runs(lib, rows, nb, threads):
            run = [task for task in range(first, end) if rows[task // nb]]
            for i, task in enumerate(run):
                got = lib.ernie_next_task(task, end, nb, ctypes.c_void_p(rows.ctypes.data))
                assert got == (run[i + 1] if i + 1 < len(run) else -1), (threads, e, nb, rows, task)


@pytest.mark.parametrize("bits,k", [(32, 136), (16, 136), (16, 128), (8, 136), (4, 136)])
@pytest.mark.parametrize("rows", [[4, 0, 4, 4, 0, 4], [1, 0, 0, 30, 2, 0], [0, 7, 5, 0, 0, 9], [20, 3, 0, 17, 0, 1]])
def test_experts_with_and_without_rows_in_one_call_equal_each_experts_own_product(isa, bits, k, rows):
    """moe_gemm's threads take runs of (expert, column block) tasks (ernie_task_run) and prefetch the next task's
    block, skipping experts without rows: every expert's rows equal its own gemm, with even rows and with one expert
    holding most, for every weight format; bfloat16 at K 128 too, where the experts
    of 16 rows or more run on AMX and the others, in the same call, on the widening tiles."""
    rng = np.random.default_rng(bits + sum(rows))
    n, e = 128, len(rows)
    if bits in (32, 16):
        ws = [cpu_gemm.packed(rng.standard_normal((k, n)).astype(np.float32), bits) for _ in range(e)]
        scales = None
    else:
        qs = [fmt.quantize_weight_only(rng.standard_normal((k, n)).astype(np.float32), bits) for _ in range(e)]
        ws, scales = [cpu_gemm.packed_codes(q, bits) for q, _ in qs], [paddle.to_tensor(s) for _, s in qs]
    counts = np.array(rows, np.int64)
    x = rng.standard_normal((int(counts.sum()), k)).astype(np.float32)
    for swiglu in (False, True):
        got = cpu_gemm.moe_gemm(x, counts, ws, n, scales, bits, swiglu=swiglu).numpy()
        at = 0
        for i, r in enumerate(rows):
            if r:
                own = cpu_gemm.gemm(x[at:at + r], ws[i], n, None if scales is None else scales[i], bits, swiglu=swiglu)
                np.testing.assert_array_equal(got[at:at + r], own.numpy())
            at += r


def test_the_kernels_thread_count_holds_in_every_calling_thread():
    """OpenMP keeps its thread count per calling thread (Paddle pins it to 1 at import); the served engine steps
    from its own thread, so the kernels take theirs from the process-wide setting instead."""
    import threading

    build.set_threads(3)
    seen = []
    t = threading.Thread(target=lambda: seen.append(build.threads()))
    t.start()
    t.join()
    build.set_threads(len(os.sched_getaffinity(0)))
    assert seen == [3]


@pytest.mark.parametrize("switch,probe,expect", [
    ({"ERNIE_CPU_KERNELS": "0"}, "build.available()", "= False"),
    ({"ERNIE_CPU_KERNELS": "yes"}, "build.available()", "ERNIE_CPU_KERNELS='yes'"),
    ({"ERNIE_CPU_AMX": "0"}, "cpu_gemm.bf16_on_amx(64, 1024)", "= False"),
    ({"ERNIE_CPU_AMX": "no"}, "cpu_gemm.bf16_on_amx(64, 1024)", "ERNIE_CPU_AMX='no'"),
    ({"ERNIE_CPU_ISA": "avx2"}, "(build.isa(), build.isas())", "= ('avx2', ['scalar', 'avx2'])"),
    ({"ERNIE_CPU_ISA": "sse"}, "build.isa()", "ERNIE_CPU_ISA='sse': expected one of scalar, avx2, avx512"),
    ({"ERNIE_CPU_ISA": "amx", "ERNIE_CPU_AMX": "0"}, "build.isa()", "ERNIE_CPU_ISA=amx with ERNIE_CPU_AMX=0"),
])
def test_the_kernel_switches_turn_them_off_or_are_refused(switch, probe, expect):
    """ERNIE_CPU_KERNELS=0: the Paddle path; ERNIE_CPU_AMX=0: bfloat16 off the tile unit; ERNIE_CPU_ISA caps the
    kernels at a tier (the library built for it says which it runs); any other value refused."""
    if "ERNIE_CPU_ISA" in switch and "avx2" not in build.cpu_isas():
        pytest.skip("no AVX2 + FMA on this CPU")
    code = ("from ernie_serve.cpu_kernels import build, cpu_gemm\n"
            f"try:\n    print('=', {probe})\nexcept ValueError as e:\n    print(e)")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **switch), capture_output=True, text=True,
                       timeout=120)
    assert expect in r.stdout, r.stderr


def test_without_amx_a_bfloat16_gemm_is_the_float32_one_on_the_rounded_weight_at_every_size():
    """ernie_set_amx(0) (ERNIE_CPU_AMX=0) in a running process: the widening tiles take every row count again."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 96)).astype(np.float32)
    x = rng.standard_normal((40, 256)).astype(np.float32)
    lib = build.library()
    lib.ernie_set_amx(0)
    try:
        assert not cpu_gemm.bf16_on_amx(40, 256)
        got = cpu_gemm.gemm(x, cpu_gemm.packed(w, bits=16), 96, None, 16).numpy()
    finally:
        lib.ernie_set_amx(1)
    np.testing.assert_array_equal(got, cpu_gemm.gemm(x, cpu_gemm.packed(_bf16(w)), 96, None, 32).numpy())


@pytest.mark.parametrize("m,k,n,n_valid", [(1, 64, 32, 32), (3, 64, 4096, 4096), (9, 128, 4096, 4000),
                                           (17, 32, 100, 100), (33, 96, 320, 317), (256, 128, 1024, 1024)])
def test_gemm_argmax_equals_numpys_argmax_over_the_stored_product(isa, m, k, n, n_valid):
    """ernie_gemm_argmax never stores x @ W; what it returns must equal NumPy's argmax / max over the first n_valid
    columns of cpu_gemm.gemm's product (the same arithmetic): ties to the lowest column, also when the tied columns
    fall to different threads, and columns past n_valid never chosen."""
    rng = np.random.default_rng(m * 7 + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:, n_valid - 1] = w[:, 0]  # a tie between the first and the last valid column
    if n > n_valid:
        w[:, n_valid:] = 50.0  # larger than any valid logit for rows with positive sums: must stay unchosen
    x = np.abs(rng.standard_normal((m, k))).astype(np.float32)
    x[0] = 0.0  # every logit 0.0: the argmax is column 0
    blocked = cpu_gemm.packed(w)
    full = cpu_gemm.gemm(x, blocked, n, None, 32).numpy()[:, :n_valid]
    idx, best = cpu_gemm.gemm_argmax(x, blocked, n, n_valid)
    assert idx.tolist() == np.argmax(full, axis=1).tolist()
    np.testing.assert_array_equal(best, full.max(axis=1))
    assert idx[0] == 0


def test_gemm_argmax_ranks_a_nan_above_everything_as_numpy_does(isa):
    """A NaN logit makes the row's max NaN (the sampler fails such a row) and its first NaN the argmax."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 2048)).astype(np.float32)
    w[3, 1500] = np.nan  # column 1500 is NaN for every row whose x[3] != 0 (0 * NaN is NaN too)
    w[3, 1700] = np.nan
    x = rng.standard_normal((4, 64)).astype(np.float32)
    x[2, 7] = np.inf  # a row whose logits are +-inf / NaN throughout
    blocked = cpu_gemm.packed(w)
    full = cpu_gemm.gemm(x, blocked, 2048, None, 32).numpy()
    idx, best = cpu_gemm.gemm_argmax(x, blocked, 2048, 2048)
    assert idx.tolist() == np.argmax(full, axis=1).tolist()
    assert np.isnan(best).tolist() == np.isnan(full.max(axis=1)).tolist() == [True] * 4


def test_gemm_argmax_refuses_what_does_not_fit():
    blocked = cpu_gemm.packed(np.ones((16, 64), np.float32))
    with pytest.raises(ValueError, match="n_valid 65"):
        cpu_gemm.gemm_argmax(np.ones((2, 16), np.float32), blocked, 64, 65)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_gemm.gemm_argmax(np.ones((2, 8), np.float32), blocked, 64, 64)


def test_int8_runs_on_amx_from_5_rows_where_the_cpu_has_it(isa):
    """AMX-INT8 takes int8 codes from 5 rows (amx.h's AMX_INT8_ROWS, where the two-level VNNI passes run out of
    cycles) when K is a multiple of 64 (a tile's 16 groups of 4); never below the amx tier."""
    has_amx = isa == "amx" and "amx_int8" in cpu_flags_line().split()
    assert cpu_gemm.int8_on_amx(5, 1024) == has_amx and cpu_gemm.int8_on_amx(16, 704) == has_amx
    assert cpu_gemm.int8_on_amx(300, 64) == has_amx
    assert not cpu_gemm.int8_on_amx(4, 1024) and not cpu_gemm.int8_on_amx(16, 96)


@pytest.mark.skipif("amx_int8" not in cpu_flags_line().split(), reason="no AMX-INT8 on this CPU")
@pytest.mark.parametrize("isa", AMX, indirect=True)
@pytest.mark.parametrize("int_x", [False, True])
@pytest.mark.parametrize("m,k,n", [(16, 64, 32), (17, 128, 40), (37, 1024, 96), (300, 192, 64), (20, 96, 64),
                                   (5, 704, 64), (7, 64, 40)])
def test_int8_on_amx_gives_the_vnni_paths_floats_bit_for_bit(isa, m, k, n, int_x):
    """TDPBSUD sums the same integer products vpdpbusd does, and both end in one epilogue: with AMX on and off
    (ernie_set_amx) a GEMM, its SwiGLU form and experts on both sides of the 5-row rule in one call give the same
    floats; a group of fewer than 16 rows, row groups of 16 and a short last one, a narrow last block, K off the tile's
    64 (falls back), one level (integer-valued x) and two."""
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    if int_x:
        x = np.round(x * 40)
    w = rng.standard_normal((k, 2 * n)).astype(np.float32)
    q, s = fmt.quantize_weight_only(w, 8)
    codes, scale = cpu_gemm.packed_codes(q, 8), paddle.to_tensor(s)
    rows = np.array([3, m, 0, 16, 1, 5, 4])  # the last expert's 4 rows: a tile of 16 from the 5-row one reads past
    xs = rng.standard_normal((int(rows.sum()), k)).astype(np.float32)

    swiglu = cpu_gemm.swiglu_fits(2 * n)  # 2 * 40 columns: a narrow last block, and no fused SwiGLU

    def products():
        return (cpu_gemm.gemm(x, codes, 2 * n, scale, 8, int_x=int_x).numpy(),
                cpu_gemm.gemm(x, codes, 2 * n, scale, 8, swiglu=swiglu, int_x=int_x).numpy(),
                cpu_gemm.moe_gemm(xs, rows, [codes] * 7, 2 * n, [scale] * 7, 8, swiglu=swiglu).numpy())

    on = products()
    lib = build.library()
    lib.ernie_set_amx(0)
    try:
        assert not cpu_gemm.int8_on_amx(m, k)
        off = products()
    finally:
        lib.ernie_set_amx(1)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)
