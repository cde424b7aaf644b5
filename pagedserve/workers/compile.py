"""`torch.compile` of the model's forward pass on the CPU (vLLM compiles on the CPU too).

What inductor buys on the CPU is fusion: each RMSNorm with the residual add before it, RoPE, and
SiLU-and-mul become single C++ loops instead of a dozen ATen calls each. The paged attention is the
opaque custom op `pagedserve::attention` (workers/layers/attention.py), so the whole stage is one
graph with 30 calls into it, and the step's metadata never enters the graph.

Shapes: the number of tokens varies every step. The token dimension of the inputs is marked
dynamic, so one graph serves every size; a first call with a single token compiles a second
graph specialized to 1 (dynamo specializes sizes 0 and 1). `num_compiles` counts the graphs, so
tests can check that steps of new sizes do not recompile.

Compiled artifacts land in inductor's on-disk cache (/tmp/torchinductor_$USER by default, or
TORCHINDUCTOR_CACHE_DIR), so a second start of the same model skips most of the compile time.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedserve.config import EngineConfig
from pagedserve.workers.parallel_state import ParallelContext


def should_compile(config: EngineConfig, device: torch.device, parallel: ParallelContext, dtype: torch.dtype) -> bool:
    """Whether this rank's model is compiled: on the CPU, at TP size 1 (the all-reduce of tensor
    parallelism would break the graph), unless `enforce_eager`; `None` compiles in half precision,
    where it pays (benchmarks/results/README.md), and keeps float32 eager."""
    if device.type != "cpu" or parallel.tp_size != 1:
        return False
    if config.enforce_eager is None:
        return dtype in (torch.bfloat16, torch.float16)
    return not config.enforce_eager


class CompiledForward:
    """`forward(input_ids, positions, hidden)` compiled by inductor, with the token dim dynamic."""

    def __init__(self, forward: Callable[..., torch.Tensor]):
        self.num_compiles = 0
        self._compiled = torch.compile(forward, backend=self._inductor, fullgraph=True, dynamic=False)

    def _inductor(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        self.num_compiles += 1
        return compile_fx(graph, example_inputs)

    def __call__(self, input_ids: torch.Tensor | None, positions: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        for tensor in (input_ids, positions, hidden):
            if tensor is not None:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return self._compiled(input_ids, positions, hidden)


def compile_model(model: nn.Module) -> None:
    """Route `model`'s steps through a compiled copy of its decoder stack (`model.model`)."""
    model.compiled_model = CompiledForward(model.model)
