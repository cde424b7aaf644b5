"""Half-precision linear layers on the CPU through oneDNN with the weight prepacked once.

`F.linear` on a bfloat16 CPU weight reorders the weight into oneDNN's blocked layout on every
call; packing it at load time (what inductor's weight freezing and vLLM's CPU backend do) saves
that: measured on SmolLM2-135M's bf16 forward, one thread, 16% of a decode step at 8 rows, 7% at
64 and nothing at 128 (`benchmarks/cpu_forward.py`). float32 stays on `F.linear` (MKL), whose
results the exactness tests pin against Hugging Face's.
"""

from __future__ import annotations

import torch

# The batch size oneDNN picks its blocking for; other sizes run correctly, a little slower.
BATCH_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.dim() == 2
        and weight.numel() > 0
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) in oneDNN's layout, for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_model(model: torch.nn.Module, exclude: torch.nn.Module | None = None) -> int:
    """Packs every layer that can take it (`pack_for_cpu`) outside `exclude` (a part torch.compile
    will trace: inductor lowers packed oneDNN linears only for weights it froze itself); returns
    how many did."""
    skipped = set(exclude.modules()) if exclude is not None else set()
    layers = [m for m in model.modules() if hasattr(m, "pack_for_cpu") and m not in skipped]
    return sum(1 for layer in layers if layer.pack_for_cpu())


def has_packed(model: torch.nn.Module) -> bool:
    return any(getattr(module, "packed_weight", None) is not None for module in model.modules())
