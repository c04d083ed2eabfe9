"""SiLU-and-mul for the dense MLPs: [T, 2I] gate|up -> silu(gate) * up [T, I], computed in fp32.

(The routed experts fuse this into their first GEMM, moe_fused.py.)"""

from __future__ import annotations

from typing import Any

from ernie_kernels._runtime import dtype_name, new_tensor, tl, triton


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, inter, stride_x, stride_y, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # t * stride passes 2^31 from ~37k tokens of 300B's 2 x 28672 columns
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + offs, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: Any) -> Any:
    """gate_up [T, 2I] (gate first) -> [T, I] in gate_up's dtype."""
    t, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_and_mul expects [T, 2I] with contiguous rows, got {list(gate_up.shape)}")
    inter = two_i // 2
    y = new_tensor(gate_up, [t, inter], dtype_name(gate_up))
    block = 256
    if t:
        _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, y, inter, gate_up.stride(0), y.stride(0),
                                                             BLOCK=block)
    return y
