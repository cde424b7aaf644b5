"""Linear layers on the CPU through oneDNN with the weight prepacked once.

`F.linear` on a bfloat16 CPU weight reorders the weight into oneDNN's blocked layout on every
call; packing it at load time (what inductor's weight freezing and vLLM's CPU backend do) saves
that: measured on SmolLM2-135M's bf16 forward, one thread, 16% of a decode step at 8 rows, 7% at
64 and nothing at 128 (`benchmarks/cpu_forward.py`). float32 is packed too: `F.linear` sends it
to MKL, which on a Zen 5 ran SmolLM2's layers 1.9-2.5x slower than oneDNN's packed GEMM
(`benchmarks/cpu_fp32_linear.py`; vLLM's CPU backend runs float32 through oneDNN as well). The two
differ by float rounding, as the native attention kernels already do from Hugging Face's; the
exactness tests hold the greedy tokens to Hugging Face's. oneDNN makes a primitive per row count,
and the caches that keep them are bounded at pagedserve's import (onednn_caches.py): unbounded,
they grew the soak test's server by 279 MiB in 6 s.

Where oneDNN has no bfloat16 GEMM on this CPU (no AVX-512: Zen 3, Intel before Skylake-SP),
torch's `F.linear` falls back to a generic bf16 loop, 5-8x slower than oneDNN's float32 GEMM from
16 rows up on a Zen 3 (level at one row; SmolLM2's layer shapes, scratch timing). There a bfloat16
weight is packed as its exact float32 copy ("widened"), and `onednn_linear` takes the bf16 input
up to float32 and the result back down. That is a bf16 GEMM's own arithmetic: bf16 values and their
products are exact in float32, the sum runs in float32, and the result is rounded to bf16 once. It
costs twice the weight memory; `PAGEDSERVE_WIDE_BF16_GEMM=0` keeps those layers on `F.linear`.
float16 is widened the same way where oneDNN cannot pack it (every CPU without AVX512-FP16 or
AVX-NE-CONVERT, a Zen 5 included): its values and products are exact in float32 as well
(`PAGEDSERVE_WIDE_FP16_GEMM=0` keeps them on `F.linear`).

A bfloat16 layer also keeps its plain weight where the native small-batch kernel runs
(`csrc/cpu_small_linear.cpp`, AVX-512 BF16): one to four rows, a decode step at light load, read
the weight faster through it than through oneDNN. That costs a second copy of the linear weights
in memory (212 MB for SmolLM2-135M; the LM head's plain weight is the embedding's) for a light
decode step's forward 1.2-1.7x faster at one to three rows and 1.06x at four, on one or two
threads of a 2-core Zen 4 (benchmarks/results/cpu_small_linear.json). Which of the one to four
row counts take it on the CPU at hand, the model runner times at start-up (small_batch_choice.py).

Where the CPU has AVX2 but no AVX-512 (a Zen 3, Intel before Skylake-SP), or runs AVX-512 in two
256-bit halves (a Zen 4), float32 layers, widened ones included, run on pagedserve's own GEMM
instead (`csrc/cpu_fp32_gemm.cpp`, the weight packed into panels of 16 output features): on a
2-core Zen 3, SmolLM2-135M's decode step forward ran 1.19x faster with it at one row, 1.24x at
eight, 1.21x at 64 and 1.05x at 128 and 256 rows, its layers alone 1.25x at 512
(benchmarks/cpu_fp32_linear.py); on a Zen 4 see `avx512_in_halves`. Its sums run in one order
whatever the batch, so a row's result does not depend on the rows beside it. Where full-width
AVX-512 is there (a Zen 5, Intel since Skylake-SP), oneDNN's GEMM uses it and stays.
`PAGEDSERVE_FP32_GEMM=onednn` or `=native` overrides the choice, which the log records.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from pagedserve.kernels import native_build

logger = logging.getLogger(__name__)

ENV_WIDE_BF16 = "PAGEDSERVE_WIDE_BF16_GEMM"
ENV_WIDE_FP16 = "PAGEDSERVE_WIDE_FP16_GEMM"
# The half-precision dtypes that are packed as float32 where oneDNN cannot pack them, and the
# variable that turns each off.
WIDENING_SWITCHES = {torch.bfloat16: ENV_WIDE_BF16, torch.float16: ENV_WIDE_FP16}

ENV_FP32_GEMM = "PAGEDSERVE_FP32_GEMM"
FP32_GEMM_CHOICES = ("auto", "native", "onednn")
# The most of the input dimension one pass of the native GEMM covers: a panel's share (64 bytes a
# k) stays within a core's L2 beside the rows.
NATIVE_K_BLOCK = 2048

# The batch size oneDNN picks its blocking for; other sizes run correctly, a little slower.
BATCH_HINT = 64
# "native" or "onednn" once `fp32_gemm` has chosen for this process.
_fp32_gemm: list[str] = []
_small_rows: list[int] = []
# The row counts at which `linear` takes the small-batch kernel: every count it takes until the
# model runner times both paths on this CPU (small_batch_choice.py) and sets them.
_kernel_rows: list[frozenset[int]] = []


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.numel() > 0
        and packed_dtype(weight.dtype) is not None
    )


def packed_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a `dtype` weight is packed in here: its own where oneDNN packs it; float32 for
    a half-precision dtype oneDNN has no GEMM for (widened, see above); None: it stays on `F.linear`."""
    if packs_dtype(dtype):
        return dtype
    switch = WIDENING_SWITCHES.get(dtype)
    if switch is not None and os.environ.get(switch, "1") != "0" and packs_dtype(torch.float32):
        return torch.float32
    return None


def packs_dtype(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU. float32 it packs wherever it runs; its
    bfloat16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, its float16 path AVX512-FP16 or
    AVX-NE-CONVERT; elsewhere packing raises, so those layers stay on `F.linear`, slower but correct."""
    mkldnn = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return mkldnn._is_mkldnn_fp16_supported()
    return False


@dataclasses.dataclass(frozen=True)
class NativeWeight:
    """A float32 weight packed for the native GEMM: `panels` [ceil(out / 16), in, 16]."""

    panels: torch.Tensor
    out_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype


def pack(weight: torch.Tensor) -> torch.Tensor | NativeWeight:
    """`weight` ([out, in]) packed for `linear`, widened to float32 where `packed_dtype` says so:
    for the native GEMM where `fp32_gemm` chose it, in oneDNN's layout otherwise."""
    if packed_dtype(weight.dtype) == torch.float32 and fp32_gemm() == "native":
        return NativeWeight(torch.ops.pagedserve_cpu.fp32_gemm_pack(weight.detach().to(torch.float32)), weight.shape[0])
    return pack_onednn(weight)


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(packed_dtype(weight.dtype)), BATCH_HINT)


def fp32_gemm() -> str:
    """Which GEMM runs float32 layers in this process, "native" or "onednn" (chosen once, logged)."""
    if not _fp32_gemm:
        _fp32_gemm.append(_choose_fp32_gemm())
    return _fp32_gemm[0]


def _choose_fp32_gemm() -> str:
    asked = os.environ.get(ENV_FP32_GEMM, "auto").strip().lower() or "auto"
    if asked not in FP32_GEMM_CHOICES:
        raise ValueError(f"{ENV_FP32_GEMM}={asked!r}: expected one of {', '.join(FP32_GEMM_CHOICES)}")
    built = native_build.load() and torch.ops.pagedserve_cpu.fp32_gemm_built()
    if asked == "native" and not built:
        raise RuntimeError(f"{ENV_FP32_GEMM}=native: the native kernels did not build with AVX2 and FMA on this machine")
    if asked == "auto":
        has_avx512, halves = "avx512" in native_build.compiled_paths(), avx512_in_halves()
        asked = "native" if built and (not has_avx512 or halves) else "onednn"
        if not built:
            why = "no native AVX2 kernel built"
        elif has_avx512:
            why = "AVX-512 in two 256-bit halves here (AMD Zen 4)" if halves else "AVX-512 here"
        else:
            why = "AVX2 without AVX-512 here"
    else:
        why = f"{ENV_FP32_GEMM}={asked}"
    logger.info("float32 linear layers run on %s (%s)", "pagedserve's native AVX2 GEMM" if asked == "native" else "oneDNN's packed GEMM", why)
    return asked


def avx512_in_halves() -> bool:
    """Whether this CPU runs a 512-bit instruction as two 256-bit halves: AMD's family 25 (Zen 3
    has no AVX-512, Zen 4 splits it; Zen 5, family 26, has full-width units). There oneDNN's
    AVX-512 float32 GEMM gains nothing in arithmetic, and on a 2-core Zen 4 the native AVX2 GEMM
    ran SmolLM2's float32 forward 1.14x (a 128-token prefill) to 1.54x (one decode row) faster
    (benchmarks/native_layers.py with each PAGEDSERVE_FP32_GEMM); its layers alone 1.41x at one
    row, 1.13x at 64, and 0.99x and 0.97x at 256 and 1024 (cpu_fp32_linear_zen4.json)."""
    return native_build.cpu_vendor_family() == ("AuthenticAMD", 25)


def linear(x: torch.Tensor, packed: torch.Tensor | NativeWeight, bias: torch.Tensor | None, plain: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) through the packed weight, or for a few rows through `plain` (the unpacked
    weight, when `keeps_plain` kept it) and the native small-batch kernel."""
    if plain is not None and x.dim() == 2 and x.shape[0] in kernel_rows() and plain.numel() > 0:
        return small_linear(x, plain, bias)
    if isinstance(packed, NativeWeight):
        return native_linear(x, packed, bias)
    return onednn_linear(x, packed, bias)


def native_linear(x: torch.Tensor, packed: NativeWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Through the native float32 GEMM; a half-precision input (a widened layer) goes up to
    float32 and its result back down once, as in `onednn_linear`."""
    # Each reshape and conversion only where it does something: a float32 model's 2-D rows skip
    # four no-op tensor calls of 1-3 us, 121 times a SmolLM2 step (a one-row decode forward 1.03x
    # and 1.23x in two runs, two rows 1.09x and 1.11x; 2-core Zen 3, cpu_forward.py --decode-rows).
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32 or rows.stride(-1) != 1:
        rows = rows.to(torch.float32).contiguous()
    out = native_gemm(rows, packed, bias.to(torch.float32).contiguous() if bias is not None else None)
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], packed.out_features)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def native_gemm(rows: torch.Tensor, packed: NativeWeight, bias: torch.Tensor | None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """rows W^T (+ bias) for float32 rows [n, in] with unit column stride and a float32 bias; with a
    `residual` ([n, out], contiguous float32), `residual + rows W^T (+ bias)`, added in the GEMM's
    store (the same bits as the separate add)."""
    out = rows.new_empty(rows.shape[0], packed.out_features)
    torch.ops.pagedserve_cpu.fp32_gemm(out, rows, packed.panels, bias, NATIVE_K_BLOCK, residual)
    return out


def native_gemm_silu_mul(rows: torch.Tensor, packed: NativeWeight) -> torch.Tensor:
    """silu(rows Wg^T) * (rows Wu^T) for an MLP's merged weight [Wg; Wu] (no bias, the intermediate
    size a multiple of 16): the bits of `native_gemm` then `cpu_native.silu_and_mul`, in one pass."""
    out = rows.new_empty(rows.shape[0], packed.out_features // 2)
    torch.ops.pagedserve_cpu.fp32_gemm_silu_mul(out, rows, packed.panels, NATIVE_K_BLOCK)
    return out


def small_linear(x: torch.Tensor, plain: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.new_empty(x.shape[0], plain.shape[0])
    torch.ops.pagedserve_cpu.small_linear(out, x if x.stride(1) == 1 else x.contiguous(), plain, bias)
    return out


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    # A widened weight: the half-precision input and bias up to float32, the result rounded back once.
    wide_bias = bias.to(packed.dtype) if bias is not None else None
    return torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, wide_bias, "none", [], "").to(x.dtype)


def kernel_rows() -> frozenset[int]:
    """The row counts that take the small-batch kernel (asked on every call: answered once)."""
    if not _kernel_rows:
        _kernel_rows.append(frozenset(range(1, small_batch_rows() + 1)))
    return _kernel_rows[0]


def set_kernel_rows(rows: frozenset[int]) -> None:
    """For the whole process: the choice is the CPU's, not a model's."""
    _kernel_rows[:] = [frozenset(r for r in rows if 1 <= r <= small_batch_rows())]


def keeps_plain(weight: torch.Tensor) -> bool:
    """Whether a packed layer keeps its plain weight too, for the small-batch kernel."""
    return weight.dtype == torch.bfloat16 and small_batch_rows() > 0


def small_batch_rows() -> int:
    """The most rows the native small-batch kernel takes here; 0: not built, or this CPU has no
    AVX-512 BF16."""
    if not _small_rows:  # asked on every call: answered once
        _small_rows.append(torch.ops.pagedserve_cpu.small_linear_max_rows() if native_build.load() else 0)
    return _small_rows[0]


def pack_model(model: torch.nn.Module, exclude: torch.nn.Module | None = None) -> int:
    """Packs every layer that can take it (`pack_for_cpu`) outside `exclude` (a part torch.compile
    will trace: inductor lowers packed oneDNN linears only for weights it froze itself); returns
    how many did."""
    skipped = set(exclude.modules()) if exclude is not None else set()
    layers = [m for m in model.modules() if hasattr(m, "pack_for_cpu") and m not in skipped]
    packed = [layer for layer in layers if layer.pack_for_cpu()]
    widened = [layer for layer in packed if layer.packed_weight.dtype != layer.weight.dtype]
    if widened:
        dtype = widened[0].weight.dtype
        logger.info(
            "%d %s linear layers packed as exact float32 copies: oneDNN has no %s GEMM on this CPU, "
            "and torch's fallback is several times slower; the weights take twice the memory (%s=0: keep them on F.linear)",
            len(widened), dtype, dtype, WIDENING_SWITCHES[dtype],
        )  # fmt: skip
    return len(packed)


def has_packed(model: torch.nn.Module) -> bool:
    return any(getattr(module, "packed_weight", None) is not None for module in model.modules())
