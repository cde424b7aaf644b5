"""Which few-row linear products take the native small-batch kernel on this CPU, chosen at
start-up by timing both paths on the model's own layers.

Where the kernel wins depends on the CPU generation, not on the instruction set alone: on the
development machine's Zen 4 (AVX-512 done in two 256-bit halves) it beats oneDNN's packed GEMM
1.1-1.6x at one to three rows and ties at four (benchmarks/results/cpu_small_linear.json); a core
that executes AVX-512 at full width (Zen 5, recent Intel) speeds oneDNN's blocked GEMM more than
a weight-streaming kernel, so the cross-over can move. Rather than a table of CPU models, the
model runner times the model's layers (streaming their weights from memory, as a decode step
does) at each row count, with the thread count light steps run on, and keeps the kernel where
it is no more than MARGIN slower than oneDNN: near a tie the established kernel stays, so that
noise does not flip the choice between starts. The choice is logged.
`PAGEDSERVE_SMALL_LINEAR_ROWS=N` skips the timing: the kernel at 1..N rows (0: never)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from pagedserve.workers.layers import cpu_gemm

logger = logging.getLogger(__name__)

ENV_OVERRIDE = "PAGEDSERVE_SMALL_LINEAR_ROWS"
MARGIN = 1.05  # the kernel stays unless oneDNN is at least 5% faster at that row count
REPEATS = 5  # interleaved rounds; the fastest of each path counts (robust to a preempted round)
# Weights streamed per timed pass, at most: several times any CPU's last-level cache, and for
# SmolLM2-135M (269 MB) its every layer; 2 paths x 4 row counts x REPEATS passes took 0.6 s on
# one thread of the Zen 4.
STREAM_BYTES = 256 * 2**20

# (rows, "kernel" or "onednn") -> seconds: the fastest round of one pass over the streamed layers
Timings = dict[tuple[int, str], float]


def choose_kernel_rows(model: torch.nn.Module, num_threads: int) -> frozenset[int]:
    """Sets (cpu_gemm.set_kernel_rows) and returns the row counts that take the kernel."""
    limit = cpu_gemm.small_batch_rows()
    override = os.environ.get(ENV_OVERRIDE)
    if override is not None:
        rows = frozenset(range(1, min(_parse_override(override), limit) + 1))
        logger.info("small-batch bf16 kernel at rows %s (%s=%s)", sorted(rows) or "none", ENV_OVERRIDE, override)
    else:
        layers = streamed_layers(model)
        if limit == 0 or not layers:
            return cpu_gemm.kernel_rows()  # nothing to choose: the kernel is not built, or no layer keeps its plain weight
        timings = time_paths(layers, limit, num_threads)
        rows = kernel_wins(timings, limit)
        detail = ", ".join(f"{r} rows {timings[(r, 'kernel')] * 1e3:.2f} against {timings[(r, 'onednn')] * 1e3:.2f} ms" for r in range(1, limit + 1))
        logger.info(
            "small-batch bf16 kernel at rows %s, oneDNN's packed GEMM elsewhere (timed on %d layers, %d threads: kernel against oneDNN %s)",
            sorted(rows) or "none", len(layers), num_threads, detail,
        )
    cpu_gemm.set_kernel_rows(rows)
    return rows


def _parse_override(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV_OVERRIDE}={text!r}: expected a row count, 0 (never the kernel) to {cpu_gemm.small_batch_rows()}")
    return value


def streamed_layers(model: torch.nn.Module, budget_bytes: int = STREAM_BYTES) -> list[torch.nn.Module]:
    """The packed bfloat16 layers that kept their plain weight, in the model's order, up to
    `budget_bytes` of weights: in a decode step each weight comes from memory, not from a cache,
    and the two paths compare differently on a cached weight (oneDNN gains more), so the timing
    streams more weights than the caches hold. One layer of each shape, timed over and over, made
    the kernel look 10% slower than oneDNN at four rows on one thread of the Zen 4, where the
    whole forward runs 1.13x faster with it."""
    layers, total = [], 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "packed_weight", None) is None or weight is None or weight.numel() == 0 or weight.dtype != torch.bfloat16:
            continue
        if layers and total + weight.nbytes > budget_bytes:
            break
        layers.append(module)
        total += weight.nbytes
    return layers


def time_paths(layers: list[torch.nn.Module], limit: int, num_threads: int, repeats: int = REPEATS) -> Timings:
    paths: dict[str, Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]] = {
        "kernel": lambda x, layer: cpu_gemm.small_linear(x, layer.weight, getattr(layer, "bias", None)),
        "onednn": lambda x, layer: cpu_gemm.onednn_linear(x, layer.packed_weight, getattr(layer, "bias", None)),
    }
    inputs = {rows: [torch.randn(rows, layer.weight.shape[1]).to(torch.bfloat16) for layer in layers] for rows in range(1, limit + 1)}
    timings: Timings = {}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                for rows, xs in inputs.items():
                    for name, path in paths.items():
                        started = time.perf_counter()
                        for x, layer in zip(xs, layers):
                            path(x, layer)
                        elapsed = time.perf_counter() - started
                        timings[(rows, name)] = min(elapsed, timings.get((rows, name), float("inf")))
    finally:
        torch.set_num_threads(threads_before)
    return timings


def kernel_wins(timings: Timings, limit: int, margin: float = MARGIN) -> frozenset[int]:
    """The row counts at which the kernel is at most `margin` times oneDNN's time."""
    return frozenset(rows for rows in range(1, limit + 1) if timings[(rows, "kernel")] <= margin * timings[(rows, "onednn")])
