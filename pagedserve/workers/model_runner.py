"""Runs one rank's share of a step: keep request state, build inputs, forward, sample.

With pipeline parallelism a stage receives the previous stage's hidden states instead of
embedding tokens, and sends its own to the next; only the driver rank (last stage, first TP rank)
samples and returns a `ModelRunnerOutput`. Every other rank returns None.
"""

from __future__ import annotations

import torch

from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.step_types.model_runner_output import ModelRunnerOutput, TokenLogprobs
from pagedserve.step_types.scheduler_output import SchedulerOutput
from pagedserve.kernels import get_attention_backend
from pagedserve.workers.cpu_binding import bind_step_threads
from pagedserve.workers.cuda_graphs import CudaGraphRunner, graphs_enabled
from pagedserve.workers.huge_pages import zeros_in_huge_pages
from pagedserve.workers.input_batch import InputBatch
from pagedserve.workers.layers.small_batch_choice import choose_kernel_rows
from pagedserve.workers.lora.context import lora_context
from pagedserve.workers.lora.manager import WorkerLoRAManager
from pagedserve.workers.step_inputs import CachedRequestState, StepInputs
from pagedserve.workers.model_loader import load_model
from pagedserve.workers.parallel_state import ParallelContext
from pagedserve.workers.sampler import Sampler, SamplerOutput
from pagedserve.workers.sampling_batch import SamplingBatchBuilder, with_grammar


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, parallel: ParallelContext, device: torch.device):
        self.engine_config = engine_config
        self.model_config = model_config
        self.parallel = parallel
        self.device = device
        self.block_size = engine_config.block_size
        if device.type == "cpu" and engine_config.num_cpu_threads is not None:
            # For the whole process: a CPU rank's process exists to run this model.
            torch.set_num_threads(engine_config.num_cpu_threads)
        self.step_threads = StepThreads.for_device(device, engine_config.light_step_cpu_threads)
        self.backend = get_attention_backend(
            engine_config.attention_backend, device.type, block_size=self.block_size, dtype=model_config.dtype
        )
        self.sampler = Sampler(engine_config.seed, device)
        # The requests this rank holds, kept across steps: a step applies only its diffs.
        self.input_batch = InputBatch(self.block_size, device, max_num_reqs=engine_config.max_num_seqs)
        self.sampling_batch = SamplingBatchBuilder(model_config.eos_token_ids, model_config.vocab_size, device)
        self.model: torch.nn.Module | None = None
        self.cuda_graphs: CudaGraphRunner | None = None  # decode-only steps, once the cache exists
        self.lora_manager: WorkerLoRAManager | None = None  # with enable_lora: the adapters this rank holds

    def load_model(self) -> None:
        self.model = load_model(self.model_config, self.parallel, self.backend, self.device, self.engine_config)
        if self.step_threads is not None:  # the CPU: light steps are where few-row products run
            choose_kernel_rows(self.model, self.step_threads.light)
            # On the thread that will step the model (it built it): its team is the one to bind.
            bind_step_threads(self.engine_config.cpu_omp_threads_bind, self.step_threads.full, self.parallel.rank)
        config = self.engine_config
        if config.enable_lora:
            self.lora_manager = WorkerLoRAManager(
                self.model, config.max_lora_rank, config.max_loras, config.max_cpu_loras, self.model_config.dtype, self.device
            )

    @property
    def hidden_size(self) -> int:
        return self.model_config.hf_config.hidden_size

    # ---- KV cache ------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        attn = layers[0]
        element = torch.empty((), dtype=self.model_config.dtype).element_size()
        return 2 * len(layers) * self.block_size * attn.num_kv_heads * attn.head_dim * element

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One tensor per local layer, in the backend's layout. Zeroed: padded block-table
        entries point at block 0, and masked-out garbage must not be NaN."""
        for attn in self.model.attention_layers():
            shape = self.backend.kv_cache_shape(num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            if self.device.type == "cpu":  # the decode attention reads blocks from anywhere in it (huge_pages.py)
                attn.kv_cache = zeros_in_huge_pages(shape, self.model_config.dtype)
            else:
                attn.kv_cache = torch.zeros(shape, dtype=self.model_config.dtype, device=self.device)
        # Graphs bake in the cache's addresses, so they are captured after it is allocated.
        if graphs_enabled(self.engine_config, self.backend, self.device):
            self.cuda_graphs = CudaGraphRunner.for_model(self.model, self.engine_config, self.model_config.max_model_len, self.device)
            self.cuda_graphs.capture()

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """A forward pass at the step's largest size, before the cache exists, to measure peak memory."""
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.model_config.max_model_len
        hidden = self._forward(input_ids, positions, None)
        if hidden is not None and self.parallel.is_last_stage:
            rows = min(num_tokens, self.engine_config.max_num_seqs)
            self.model.compute_logits(hidden[:rows])

    # ---- a step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.lora_manager is None:
            return self._execute(scheduler_output)
        self.lora_manager.prefetch(scheduler_output.prefetch_loras)
        self.lora_manager.retire(scheduler_output.retired_lora_ids)
        output = self._execute(scheduler_output)
        if output is not None:
            output.ready_lora_ids = self.lora_manager.ready_ids()
        return output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self.input_batch.update(scheduler_output)
        if self.lora_manager is not None:
            self._load_adapters(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty() if self.parallel.is_driver else None
        inputs = self.input_batch.prepare(scheduler_output)
        if self.step_threads is not None:
            self.step_threads.set_for(inputs.num_tokens, len(scheduler_output.num_scheduled_tokens))
        if self.cuda_graphs is not None and inputs.lora_groups is None and self.cuda_graphs.can_run(inputs.meta):
            hidden, pruned = self.cuda_graphs.run(inputs.input_ids, inputs.positions, inputs.meta), False
        else:
            pruned = _prunes_last_layer(inputs)
            with lora_context(inputs.lora_groups):
                hidden = self._forward(inputs.input_ids, inputs.positions, inputs, inputs.logits_indices if pruned else None)
        if hidden is None or not inputs.sampled_states:
            return ModelRunnerOutput.empty() if self.parallel.is_driver else None
        # When every token samples (all decodes) its rows are the hidden states, in order.
        if not pruned and len(inputs.sampled_states) != inputs.num_tokens:
            hidden = hidden.index_select(0, inputs.logits_indices)
        logits = self.model.compute_logits(hidden)
        if not self.parallel.is_driver:
            return None
        batch = self.sampling_batch.build(inputs.sampled_states)
        if scheduler_output.grammar_bitmask is not None:
            batch = with_grammar(batch, scheduler_output, inputs.sampled_states, self.device)
        return _to_runner_output(inputs.sampled_states, self.sampler(logits, batch))

    def _load_adapters(self, scheduler_output: SchedulerOutput) -> None:
        """The adapters of the step's new requests, resident before the forward pass; removed
        adapters no request of the batch uses, dropped."""
        new = [r.lora_request for r in scheduler_output.scheduled_new_reqs if r.lora_request is not None]
        if new or self.lora_manager.retiring:
            in_use = {int(i) for i in self.input_batch.lora_ids[list(self.input_batch.row_of.values())] if i}
            self.lora_manager.drop_retired(in_use)
            self.lora_manager.ensure(new, in_use)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs: StepInputs | None, sampled_rows: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """This stage's part of the forward pass; None on every stage but the last, which returns
        only `sampled_rows` where given (LlamaModel.forward)."""
        meta = inputs.meta if inputs is not None else None
        hidden = None
        if not self.parallel.is_first_stage:
            shape = (input_ids.shape[0], self.hidden_size)
            hidden = self.parallel.recv_from_previous_stage(shape, self.model_config.dtype, self.device)
        hidden = self.model(input_ids, positions, meta, hidden, sampled_rows if self.parallel.is_last_stage else None)
        if not self.parallel.is_last_stage:
            self.parallel.send_to_next_stage(hidden)
            return None
        return hidden


def _prunes_last_layer(inputs: StepInputs) -> bool:
    """Whether the last layer runs past its attention for the sampled rows alone: where some rows
    sample and some do not (a prefill chunk), and no adapter is in the step (the adapters' rows
    are laid out for the whole step, workers/lora/context.py). A step that samples nothing (a
    long prompt's middle chunk alone) keeps every row, so no kernel is asked for zero rows."""
    return inputs.lora_groups is None and 0 < len(inputs.sampled_states) < inputs.num_tokens


class StepThreads:
    """Fewer torch threads for light CPU steps (`light_step_cpu_threads`): a step of at most 4
    tokens, and a step that only decodes (one token per request, whatever the rows). In both, the
    server's other processes (the Serve replica, ingress and proxy) have work proportional to the
    step's rows, about 1 ms of CPU per streamed token on a 2-core Zen 5. With the model on every
    core they take one of its cores mid-step, and the model's threads wait for each other at every
    op; with the model on one core fewer that work runs beside the step instead. A prefill needs
    no such streaming and its products gain most from a second thread, so steps that carry
    prefill tokens take every thread.

    Measured under `pagedserve serve`, SmolLM2-135M bf16:
    - at most 4 tokens, on a 2-core Zen 4 (benchmarks/results/server_defaults/): ITL p50 at 1 req/s
      18.9-19.1 against 22.2-25.3 ms, saturation throughput 220-235 against 239-240 tok/s with
      two threads everywhere; a limit of 16 tokens there cost saturation throughput (212-213
      tok/s; git history before commit 5c62dd7);
    - every decode-only step, on a 2-core Zen 5 (benchmarks/results/decode_threads_zen5/, and
      scratch saturation bursts in docs/benchmarks.md): 1.09-1.12x the output throughput and
      0.86-0.96x the ITL p50 at 16 requests in flight, level to 1.09x at 128; saturation bursts
      497-534 against 448-458 tok/s, ITL p50 134-151 against 161-173 ms, and the engine's CPU per
      burst 32 against 41 s (its two threads had spent the rest waiting for each other).
      Not measured on a Zen 4, where the 16-token limit above (which ran decodes of 5-16 rows on
      one thread too) had cost throughput.
    - with the engine in the ingress's process (`engine_host: ingress`, one process fewer per
      streamed token), every step on both threads wins instead: 653-692 against 573-589 tok/s at
      256 in flight, 567-574 against 500-503 at 32, 355-363 against 314-329 at 8 (2-core Zen 5), so
      `pagedserve serve` sets no light count there (cluster/launcher.py: machine_defaults).

    Every CPU step also checks the count on the thread that runs it: a thread takes its count
    from the process-wide setting when it first runs a parallel op, and another thread (the
    LoRA reader sets one for itself) may have changed that setting before a step thread's first
    op, which would then run every step on one thread."""

    LIGHT_STEP_TOKENS = 4

    def __init__(self, full: int, light: int | None = None):
        self.full = full
        self.light = full if light is None else min(light, full)

    @classmethod
    def for_device(cls, device: torch.device, light: int | None) -> StepThreads | None:
        return cls(torch.get_num_threads(), light) if device.type == "cpu" else None

    def set_for(self, num_tokens: int, num_reqs: int) -> None:
        decode_only = num_tokens == num_reqs
        wanted = self.light if decode_only or num_tokens <= self.LIGHT_STEP_TOKENS else self.full
        if torch.get_num_threads() != wanted:  # this thread's own count
            torch.set_num_threads(wanted)


def _to_runner_output(states: list[CachedRequestState], out: SamplerOutput) -> ModelRunnerOutput:
    req_ids = [s.req_id for s in states]
    result = ModelRunnerOutput(req_ids, out.sampled_token_ids.tolist())
    if out.logprobs is None:
        return result
    ids, values, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
    result.logprobs = {}
    for row, state in enumerate(states):
        n = state.sampling_params.logprobs
        if n is not None:
            result.logprobs[state.req_id] = TokenLogprobs(ids[row][: n + 1], values[row][: n + 1], ranks[row])
    return result
