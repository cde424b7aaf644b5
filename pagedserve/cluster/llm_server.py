"""LLMServer: the Ray Serve deployment that hosts one AsyncLLM.

Its workers go into the bundles of the replica's placement group that app.py gives it. It streams
`RequestOutput`s to the ingress, and turns bad input into an `ErrorInfo` item rather than an
exception, so the ingress can answer with the right status before it starts a stream. Every second
it reports its engine statistics to the metrics hub, which renders them for /metrics as this
replica's series (a `replica` label; sums over replicas belong in PromQL). Sent SIGTERM, it
drains: its streams move to other replicas, then it exits (cluster/replica_drain.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any, AsyncIterator

from pagedserve.cluster.autoscaling import BATCH_USAGE_METRIC, KV_USAGE_METRIC, NUM_WAITING_METRIC
from pagedserve.cluster.ray_internals import SigtermHook
from pagedserve.cluster.replica_drain import ENGINE_STOP_S, ReplicaDrain, end_actor, exit_by_deadline
from pagedserve.cluster.routing_stats import RoutingStatsReporter
from pagedserve.cluster.server_config import ServerConfig
from pagedserve.cluster.stream_items import ErrorInfo, Handover, StreamItem, overloaded
from pagedserve.cluster.tokenizer_thread import TokenizerThread
from pagedserve.config import WorkerPlacement
from pagedserve.engine.async_llm import AsyncLLM, EngineOverloadedError
from pagedserve.engine.input_processor import ResumeState
from pagedserve.engine.llm_engine import EngineDeadError
from pagedserve.engine.metrics import EngineStats
from pagedserve.engine.request_output import RequestOutput
from pagedserve.engine.tokenizer import TextLimit
from pagedserve.inputs import ServerPrompt, is_chat_prompt, is_tokens_prompt, tokens_prompt
from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

STATS_REPORT_INTERVAL_S = 1.0


class LLMServer:
    def __init__(
        self, config: ServerConfig, metrics_hub: Any = None, worker_bundle_indices: tuple[int, ...] = (), drains_on_sigterm: bool = True
    ):
        """`worker_bundle_indices`: the bundles of this replica's placement group that hold the
        engine's ranks, in rank order (app.py lays the group out); none: the engine runs here.
        `drains_on_sigterm`: a SIGTERM hands the streams over to other replicas (replica_drain.py);
        False where there are none (the engine in the ingress's process, local_engine.py)."""
        import ray
        from ray import serve

        import torch

        engine_config = config.replica_engine_config(has_gpu=torch.cuda.is_available())
        placement = None
        if worker_bundle_indices:
            placement = WorkerPlacement(ray.util.get_current_placement_group(), tuple(worker_bundle_indices))
        self.llm = AsyncLLM(engine_config, placement)
        for adapter in config.lora_requests():  # checked at start: a bad folder fails the replica, naming it
            self.llm.engine.add_lora(adapter)
        self.max_model_len = self.llm.engine.model_config.max_model_len
        # Every use of the engine's tokenizer here goes through this thread: never on the loop.
        self.tokenizer = TokenizerThread(self.llm.tokenizer, TextLimit.of(self.llm.tokenizer, self.max_model_len))
        self.tokenizer_size = len(self.llm.tokenizer)
        self.model_name = config.model_name
        self.stream_interval_s = config.stream_interval_ms / 1000
        replica_id = serve.get_replica_context().replica_id
        self.replica_id = str(replica_id)
        self.metrics_hub = metrics_hub
        core = getattr(self.llm.engine.engine_core, "engine_core", None)  # None: the core runs in its own process
        self.routing_stats = RoutingStatsReporter(core.kv_cache_manager.pool if core is not None else None)
        self._stopped = threading.Event()
        if metrics_hub is not None:
            threading.Thread(target=self._report_stats, name="pagedserve-stats", daemon=True).start()
        # Serve constructs the replica on its event loop, where generate runs too.
        self.drain = ReplicaDrain(Handover(replica_id.unique_id), config.drain_timeout_s, self._exit_drained)
        self.drains_on_sigterm = drains_on_sigterm
        if drains_on_sigterm:
            SigtermHook(self.drain.on_sigterm).install()

    async def generate(
        self, request_id: str, prompt: ServerPrompt, params: SamplingParams, resume: ResumeState | None = None
    ) -> AsyncIterator[StreamItem]:
        """`prompt`: text, a TokensPrompt, or a ChatPrompt (pagedserve/inputs.py).
        `resume`: what the client already has of a request another replica began (handover.py).
        A draining replica answers with a Handover alone: the ingress goes to another replica."""
        if self.drain.is_draining:
            yield self.drain.handover
            return
        try:
            prompt, lora_request = _without_adapter(prompt)
            prompt = await self._tokenized(prompt)
            outputs = self.llm.generate(prompt, params, request_id, resume, lora_request)
            if params.output_kind == RequestOutputKind.DELTA:
                outputs = self._batched(outputs)
            # Without a drain nothing can move the stream: no race against one on every item.
            stream = self.drain.stream(outputs, params) if self.drains_on_sigterm else outputs
            try:
                async for output in stream:
                    yield output
            finally:  # closed early (the client went away): the engine aborts the request now
                await outputs.aclose()
        except ValueError as error:
            yield ErrorInfo(400, str(error))
        except EngineOverloadedError as error:
            yield overloaded(str(error))
        except EngineDeadError as error:
            yield ErrorInfo(503, f"the engine is not running: {error}", "ServiceUnavailableError")

    async def _tokenized(self, prompt: ServerPrompt) -> ServerPrompt:
        """Text and conversations (sent here when the ingress has no tokenizer) as token ids,
        encoded on the tokenizer's thread, so the engine does not encode on this loop. The
        prompt's prefix-cache salt stays with it."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if is_chat_prompt(prompt):
            tokenized = await self.tokenizer.render_chat(
                prompt["messages"], prompt.get("add_generation_prompt", True), prompt.get("tools")
            )
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str) and not is_tokens_prompt(prompt):
            tokenized = tokens_prompt(await self.tokenizer.encode(prompt["prompt"]), prompt["prompt"])
        elif isinstance(prompt, str):
            tokenized = tokens_prompt(await self.tokenizer.encode(prompt), prompt)
        else:
            return prompt
        if salt is not None:
            tokenized["cache_salt"] = salt
        return tokenized

    async def _batched(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Stream items cost the Serve path far more than tokens cost the engine, so deltas that
        pile up while the previous item is being sent go out merged (AsyncLLM's stream folds
        them), while an idle stream's token goes out at once. `stream_interval_ms` > 0 also
        waits that long after each item, merging more. Items after the first leave the prompt
        out: the ingress already has it."""
        is_first = True
        try:
            async for output in outputs:
                if not is_first:
                    output = dataclasses.replace(output, prompt=None, prompt_token_ids=[], metrics=None)
                is_first = False
                yield output
                if self.stream_interval_s and not output.finished:
                    await asyncio.sleep(self.stream_interval_s)
        finally:
            await outputs.aclose()

    async def tokenize(self, prompt: str | None, messages: list[dict] | None, add_special_tokens: bool) -> list[int] | ErrorInfo:
        """Token ids as the engine would see them; text that cannot fit in max_model_len is a 400
        before it is encoded."""
        try:
            if messages is not None:
                return (await self.tokenizer.render_chat(messages))["prompt_token_ids"]
            return await self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        except ValueError as error:
            return ErrorInfo(400, str(error), param="messages" if messages is not None else "prompt")

    async def detokenize(self, tokens: list[int]) -> str | ErrorInfo:
        vocab = self.llm.engine.model_config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            return ErrorInfo(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        # Ids past the tokenizer (embedding padding) decode to nothing, as in generation.
        return await self.tokenizer.decode([t for t in tokens if t < self.tokenizer_size])

    async def check_lora(self, lora_request: LoRARequest) -> ErrorInfo | None:
        """Check an adapter's folder as the engine will read it (the ingress loads adapters)."""
        try:
            await asyncio.to_thread(self.llm.engine.add_lora, lora_request)
        except ValueError as error:
            return ErrorInfo(400, str(error), param="lora_path")
        return None

    async def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "max_model_len": self.max_model_len}

    async def prompt_spec(self) -> dict[str, Any]:
        """What the ingress needs to tokenize for this engine (it resolves and loads the same
        tokenizer itself, so prompts reach the router as token ids)."""
        config = self.llm.config
        return {"model": config.model, "tokenizer": config.tokenizer, "revision": config.revision, "max_model_len": self.max_model_len}

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing-stats hook (every deployment.routing_stats_period_s): engine load and
        the KV cache's evictions since the last report, for the prefix-aware router."""
        return self.routing_stats.report(self.llm.stats(), self.drain.is_draining, self.llm.engine.list_loras()).to_dict()

    async def is_healthy(self) -> bool:
        return self.llm.is_healthy

    def check_health(self) -> None:
        """Serve's replica health check: a dead engine gets the replica replaced."""
        if not self.llm.is_healthy:
            raise RuntimeError(f"engine is dead: {self.llm.dead_reason}")

    def stats(self) -> EngineStats:
        return self.llm.stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook for custom autoscaling metrics: the engine's load, which
        autoscaling.EngineLoadPolicy turns into a replica count."""
        stats = self.llm.stats()
        return {
            NUM_WAITING_METRIC: float(stats.num_requests_waiting),
            KV_USAGE_METRIC: stats.kv_cache_usage_perc,
            BATCH_USAGE_METRIC: stats.num_requests_running / self.llm.config.max_num_seqs,
        }

    async def _exit_drained(self) -> None:
        """The drain's end: no stream is left here. Stop the engine, then the actor."""
        self._stopped.set()
        exit_by_deadline()
        started = time.monotonic()
        await asyncio.to_thread(self.llm.shutdown, ENGINE_STOP_S)
        logger.warning("drained: the engine stopped in %.2f s; ending the actor", time.monotonic() - started)
        end_actor()

    def _report_stats(self) -> None:
        """Each second: the engine's statistics to the hub, whose reply names the adapters
        /v1/unload_lora_adapter retired (metrics_hub.py); those this engine holds are dropped."""
        while not self._stopped.wait(STATS_REPORT_INTERVAL_S):
            try:
                retired = self.metrics_hub.report.remote(self.model_name, self.replica_id, self.llm.stats()).result(timeout_s=10)
            except Exception:  # the hub restarting must not take the replica down
                logger.debug("could not report stats", exc_info=True)
                continue
            for lora_int_id in set(retired or ()) & self.llm.engine.list_loras():
                self.llm.engine.remove_lora(lora_int_id)
                logger.info("LoRA adapter %d retired by the ingress: dropped", lora_int_id)

    def __del__(self) -> None:
        stopped = getattr(self, "_stopped", None)
        if stopped is not None:
            stopped.set()
            self.llm.shutdown()


def _without_adapter(prompt: ServerPrompt) -> tuple[ServerPrompt, LoRARequest | None]:
    """The prompt the engine takes, and the adapter the ingress put beside it (inputs.py)."""
    if not isinstance(prompt, dict) or "lora_request" not in prompt:
        return prompt, None
    rest = dict(prompt)
    lora_request = rest.pop("lora_request")
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise ValueError("lora_request must be a LoRARequest")
    return rest, lora_request
