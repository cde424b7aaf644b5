"""Per-request state kept on a worker between steps, and the tensors of one step (InputBatch in
input_batch.py builds them; tests/workers/step_inputs_reference.py builds the same from scratch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.kernels import AttentionMetadata
from pagedserve.sampling_params import SamplerParams


@dataclass
class CachedRequestState:
    """What a worker remembers of a request; updated by each step's diffs."""

    req_id: str
    token_ids: list[int]  # prompt + outputs known so far
    num_prompt_tokens: int
    sampling_params: SamplerParams  # (tests may hand a SamplingParams: the same field names)
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] rows of the hidden states to compute logits for
    # Parallel to logits_indices: InputBatch's rows (BatchRow), which read as CachedRequestState.
    sampled_states: list[CachedRequestState]
    lora_groups: Any = None  # workers/lora/context.LoRAGroups: the adapters' token rows, if any

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device` (shared memory on the CPU, an async copy elsewhere)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.to(device, non_blocking=True) if device.type != "cpu" else tensor
