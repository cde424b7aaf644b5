"""Structured outputs on the worker: the engine's packed grammar bitmask rows, unpacked and laid
over the logits of the rows that sample under a grammar.

The engine sends one int32 row per constrained request (bit i of word i // 32 set: token i
allowed). Columns past the bitmask (logits wider than the vocabulary the engine knows) are never
allowed; neither is the vocabulary's padding past the tokenizer, which the engine's backends
always leave unset.
"""

from __future__ import annotations

import torch

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor) -> torch.Tensor:
    """[rows, words] int32 -> [rows, 32 * words] bool: token i allowed iff bit i % 32 of word i // 32."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1
    return bits.reshape(bitmask.shape[0], -1).bool()


def apply_grammar(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of `rows` its grammar does not allow."""
    vocab = logits.shape[-1]
    if allowed.shape[-1] < vocab:  # logits wider than the bitmask: those columns are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    selected = logits.index_select(0, rows)
    logits.index_copy_(0, rows, selected.masked_fill(~allowed[:, :vocab], float("-inf")))
