"""CUDA graphs for decode-only steps.

A decode step of a small model is mostly kernel-launch overhead: dozens of launches per layer,
each a few microseconds of CPU time, for kernels that run shorter than that. Capturing the forward
pass once per batch size and replaying it costs one launch.

A graph replays fixed shapes at fixed addresses, so:
- batch sizes are captured at a few sizes (`capture_sizes`) and a step pads up to the next one;
- inputs and attention metadata live in static buffers (`DecodeBuffers`) copied into per step;
- padded rows write no cache slot (slot -1, which the K/V writers skip) and attend to nothing
  (seq_len 0, output 0); their hidden states are dropped before the LM head, so they cannot
  change a sampled token;
- only backends that read lengths on the device take part (`GRAPH_SAFE_BACKENDS`): the torch
  reference loops over host lists, which a graph would freeze.

Graphs are off with `enforce_eager`, on the CPU, and with more than one rank (the collectives of
tensor and pipeline parallelism are not captured).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.config import EngineConfig
from pagedserve.kernels import AttentionBackend, AttentionMetadata
from pagedserve.kernels.backend import GRAPH_SAFE_BACKENDS
from pagedserve.kernels.metadata import PAD_SLOT_ID

# Above this many sequences a decode step is compute-bound enough that launches do not matter,
# and each captured size holds its own activations.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to `max_num_seqs` (capped), which itself is included:
    padding wastes at most 7 rows past 8."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [size for size in [1, 2, 4, *range(8, limit + 1, 8)] if size <= limit]
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows; None when none does."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


def graphs_enabled(config: EngineConfig, backend: AttentionBackend, device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and not config.enforce_eager
        and backend.name in GRAPH_SAFE_BACKENDS
        and config.world_size == 1
    )


class DecodeBuffers:
    """The static inputs of every captured decode graph: the first `size` rows of each buffer
    are the inputs of the graph of that size."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, max_model_len: int, device: torch.device):
        self.max_model_len = max_model_len
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_size,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_size, dtype=torch.int32, device=device)
        # One query token per sequence: query_start_loc is 0, 1, 2, ... for every size.
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_size, max_blocks_per_seq, dtype=torch.int32, device=device)

    def meta(self, size: int) -> AttentionMetadata:
        """Metadata over the buffers' first `size` rows. Its host fields are bounds, not this
        step's values: graph-safe backends read only the tensors and `max_query_len`."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            num_decodes=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_host=list(range(size + 1)),
            seq_lens_host=[self.max_model_len] * size,
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy a decode-only step of `n <= size` sequences into the buffers; rows n..size-1
        become padding that writes and reads no cache slot."""
        n = input_ids.shape[0]
        assert meta.num_decodes == meta.num_seqs == n <= size, "only decode-only steps replay a graph"
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # Columns past `width` keep stale block ids: they lie past seq_len, so are never read.
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(PAD_SLOT_ID)
        self.seq_lens[n:size].zero_()


class CudaGraphRunner:
    """Captures the model's forward pass for decode-only batches and replays it."""

    def __init__(self, model: nn.Module, sizes: list[int], buffers: DecodeBuffers):
        self.model = model
        self.sizes = sizes
        self.buffers = buffers
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states, at a fixed address
        self.num_replays = 0

    @classmethod
    def for_model(cls, model: nn.Module, config: EngineConfig, max_model_len: int, device: torch.device) -> CudaGraphRunner:
        sizes = capture_sizes(config.max_num_seqs)
        max_blocks_per_seq = -(-max_model_len // config.block_size)
        return cls(model, sizes, DecodeBuffers(sizes[-1], max_blocks_per_seq, max_model_len, device))

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first, all in one memory pool: smaller graphs reuse the larger's blocks."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self.buffers.meta(size)
            ids, positions = self.buffers.input_ids[:size], self.buffers.positions[:size]
            # Eager warm-up runs compile the Triton kernels for this shape and initialise cuBLAS
            # outside the capture, where neither is allowed.
            for _ in range(2):
                self.model(ids, positions, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(ids, positions, meta)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.num_decodes == meta.num_seqs and padded_size(meta.num_seqs, self.sizes) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the step's rows (padding dropped). The returned view is overwritten by
        the next replay: use it before the next step."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        self.buffers.load(input_ids, positions, meta, size)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:n]
