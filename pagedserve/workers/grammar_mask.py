"""Structured outputs on the worker: the engine's packed grammar bitmask rows laid over the
logits of the rows that sample under a grammar.

The engine sends one int32 row per constrained request (bit i of word i // 32 set: token i
allowed). Columns past the bitmask (logits wider than the vocabulary the engine knows) are never
allowed; neither is the vocabulary's padding past the tokenizer, which the engine's backends
always leave unset. On the CPU a native kernel reads the packed words directly
(csrc/cpu_grammar_mask.cpp); elsewhere torch unpacks them to one bool per token first.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.kernels import native_build


def unpack_bitmask(bitmask: torch.Tensor) -> torch.Tensor:
    """[rows, words] int32 -> [rows, 32 * words] bool: token i allowed iff bit i % 32 of word i // 32.

    One byte per token through numpy's unpackbits: the little-endian bytes of word w hold tokens
    32w..32w+31 in order, least significant bit first. (Shifting the int32 words 32 ways made a
    32x larger int32 tensor first: 3 ms a step at 64 rows of a 49k vocabulary.)"""
    words = np.ascontiguousarray(bitmask.numpy(), dtype="<i4")
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)


def apply_grammar(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of `rows` its grammar does not allow. `bitmask`: the
    packed rows ([len(rows), words] int32, on the CPU), one per entry of `rows`."""
    if _native_takes(logits, rows):
        torch.ops.pagedserve_cpu.grammar_mask(logits, rows, bitmask.contiguous())
        return
    mask_unpacked(logits, rows, unpack_bitmask(bitmask).to(logits.device))


def _native_takes(logits: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether the native kernel masks these logits (float32 on the CPU, the kernels built)."""
    return (
        logits.device.type == "cpu"
        and rows.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.is_contiguous()
        and native_build.load()
    )


def mask_unpacked(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """apply_grammar in torch, from the unpacked rows ([len(rows), >= vocab] bool)."""
    vocab = logits.shape[-1]
    if allowed.shape[-1] < vocab:  # logits wider than the bitmask: those columns are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    forbidden = allowed[:, :vocab].logical_not()
    if rows.numel() == logits.shape[0] and torch.equal(rows, torch.arange(logits.shape[0], device=rows.device)):
        logits.masked_fill_(forbidden, float("-inf"))  # every row constrained: no gather, no scatter
        return
    selected = logits.index_select(0, rows)
    logits.index_copy_(0, rows, selected.masked_fill_(forbidden, float("-inf")))
