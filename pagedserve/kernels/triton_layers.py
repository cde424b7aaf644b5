"""RMSNorm, rotary embedding and SiLU-and-mul on CUDA, each one Triton kernel.

In torch these layers are a dozen small ops each (RMSNorm seven, the rotation of q or k about
fourteen): with 16 layers, several hundred kernels per decode step. On an H200 a decode step of
Llama-3.2-1B's shapes at batch 1 took 2.46 ms under CUDA graphs against a 0.52 ms HBM roofline,
and the host waited 1.96 ms of it on the GPU (benchmarks/gpu_decode.py's host profile), so the
GPU, busy with those small kernels, set the pace.

RMSNorm and SiLU-and-mul round where torch rounds (Hugging Face's order), so they agree with the
torch path to within the order of a float32 sum. The rotation is done in float32 from the float32
cos/sin tables and rounded once, as the CPU's fused kernel does (csrc/cpu_layers.cpp; torch rounds
the tables and each product first): within a rounding of the dtype. The layers reach these
through `cuda_layers`, which needs no triton to import. Set TRITON_INTERPRET=1 before this module
is imported to run it on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    # HF: normalize in float32, round to the input's dtype, then times the weight in that dtype.
    dtype = out_ptr.dtype.element_ty
    out = w.to(tl.float32) * normed.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] with unit stride in the last dim; weight: [hidden], x's dtype."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        n = rows.shape[1]
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), n, eps, BLOCK=block, num_warps=min(max(block // 256, 1), 16)
        )
    return out.view(x.shape)


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_table, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    dim_ok = dims < HALF
    ok = (heads[:, None] < num_heads) & dim_ok[None, :]
    pos = tl.load(pos_ptr + token).to(tl.int64)
    first = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(first, mask=ok, other=0.0)
    x2 = tl.load(first + HALF, mask=ok, other=0.0)
    # In float32 from the float32 tables, rounded once at the store.
    cos = tl.load(cos_ptr + pos * stride_table + dims, mask=dim_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + dims, mask=dim_ok, other=0.0)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    dest = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(dest, (a * cos - b * sin).to(x1.dtype), mask=ok)
    tl.store(dest + HALF, (b * cos + a * sin).to(x1.dtype), mask=ok)


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotate-half rotation of x: [tokens, heads, head_dim] (unit stride in the last dim) by
    the float32 tables cos, sin: [max_positions, head_dim // 2] at `positions`. A new tensor."""
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            x, positions, cos, sin, out,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), num_heads,
            HALF=half, BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half),
        )
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    # torch: silu rounded to the dtype, then the product rounded again.
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [..., gate | up] with unit stride in the last dim."""
    rows = _rows(x)
    n = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = min(triton.next_power_of_2(n), 1024)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, rows.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*x.shape[:-1], n)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride along a row (the kernels' addressing)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()
