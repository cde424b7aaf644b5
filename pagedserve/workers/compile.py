"""`torch.compile` of the model's forward pass on the CPU (vLLM compiles on the CPU too).

What inductor buys on the CPU is fusion: each RMSNorm with the residual add before it, RoPE, and
SiLU-and-mul become single C++ loops instead of a dozen ATen calls each. The paged attention is the
opaque custom op `pagedserve::attention` (workers/layers/attention.py), so the whole stage is one
graph with one call into it per layer, and the step's metadata never enters the graph.

Shapes: the number of tokens varies every step. The token dimension of the inputs is marked
dynamic, so one graph serves every size. Dynamo would specialize a size of 1 (a step of one
decode) into a graph of its own, compiled in the middle of serving; such a step is padded to two
tokens instead (the attention op sees only the step's real tokens and leaves the padding row at
zero), so one graph is all there is. `num_compiles` counts graphs, so tests can check that.

Compiled artifacts land in inductor's on-disk cache (/tmp/torchinductor_$USER by default, or
TORCHINDUCTOR_CACHE_DIR), so a second start of the same model can skip inductor's code generation
(dynamo still traces the model again; how much a warm start saves was not measured).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedserve.config import EngineConfig
from pagedserve.workers.layers import cpu_gemm
from pagedserve.workers.layers.attention import forward_context
from pagedserve.workers.parallel_state import ParallelContext


def should_compile(config: EngineConfig, device: torch.device, parallel: ParallelContext) -> bool:
    """Whether this rank's model is compiled: only when asked (`enforce_eager=False`), on the CPU, at
    TP size 1 (the all-reduce of tensor parallelism would break the graph). The default (None)
    stays eager: on a 2-core Zen 4 the compiled bf16 forward of SmolLM2 is no faster than the eager
    one with the native kernels (0.98x at 128 decode rows, 0.97x on a 512-token prefill, after 34 s
    of compiling: benchmarks/results/cpu_forward_bf16.json)."""
    return device.type == "cpu" and parallel.tp_size == 1 and config.enforce_eager is False


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
        num_tokens = positions.shape[0]
        inputs = [input_ids, positions, hidden]
        for i, tensor in enumerate(inputs):
            if tensor is not None:
                if num_tokens == 1:
                    tensor = torch.cat([tensor, tensor])
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
                inputs[i] = tensor
        return self._compiled(*inputs)[:num_tokens]


def compile_model(model: nn.Module) -> None:
    """Route `model`'s steps through a compiled copy of its decoder stack (`model.model`), and
    compile it now, while the engine starts: compiling in the first step would stall it for as
    long as the compile takes, which `step_timeout_s` may mistake for a wedged worker. The warm-up
    pass runs before the cache exists (attention takes its profiling path), which the graph does
    not see: attention is an opaque op, so the same graph serves the steps."""
    if cpu_gemm.has_packed(model.model):
        raise ValueError("compile a model loaded for compiling (load_model with enforce_eager=False): its linear weights are packed")
    compiled = CompiledForward(model.model)
    is_first_stage = model.model.embed_tokens is not None
    dtype = next(model.parameters()).dtype
    # Made in inference mode, like a step's inputs: dynamo guards on the kind of tensor too.
    with torch.inference_mode(), forward_context(None, model.attention_by_index):
        input_ids = torch.zeros(2, dtype=torch.long) if is_first_stage else None
        hidden = None if is_first_stage else torch.zeros(2, model.config.hidden_size, dtype=dtype)
        compiled(input_ids, torch.arange(2), hidden)
    model.compiled_model = compiled
