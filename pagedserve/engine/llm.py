"""The offline API, with vLLM's names: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import atexit
import itertools
import time
import weakref
from typing import Any, Sequence

from tqdm.auto import tqdm

from pagedserve.config import EngineConfig
from pagedserve.engine.chat import render_chat
from pagedserve.engine.engine_core_output import FinishReason
from pagedserve.engine.generation_config import generation_defaults
from pagedserve.engine.input_processor import PromptType
from pagedserve.engine.llm_engine import EngineDeadError, LLMEngine
from pagedserve.engine.request_output import RequestOutput
from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """An engine for batch generation: in this process, or with `engine_core_process=True` its
    core in a child process while this one tokenizes and detokenizes. Every keyword argument is a
    field of `EngineConfig` (see pagedserve/config.py); an unknown one is an error naming it."""

    def __init__(self, model: str, **kwargs: Any):
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine(config)
        self._request_counter = itertools.count()
        self._default_params: SamplingParams | None = None
        # Release workers and caches on shutdown(), garbage collection or interpreter exit.
        self._finalizer = weakref.finalize(self, LLMEngine.shutdown, self.llm_engine)
        atexit.register(self._finalizer)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: the model author's sampling from
        its generation_config.json (EngineConfig.generation_config), as vLLM's LLM does."""
        if self._default_params is None:
            config = self.llm_engine.config
            defaults = generation_defaults(config.generation_config, self.llm_engine.model_config.model_path)
            self._default_params = SamplingParams(**defaults)
        return self._default_params

    def shutdown(self) -> None:
        self._finalizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order. `lora_request`: one adapter
        for all, or one entry per prompt (None: the base model); needs enable_lora=True."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        request_ids = self._add_requests(prompt_list, params_list, _per_prompt(lora_request, len(prompt_list)))
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [render_chat(tokenizer, c, chat_template, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _params_per_prompt(self, sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * num_prompts
        else:
            params_list = list(sampling_params)
            if len(params_list) != num_prompts:
                raise ValueError(
                    f"got {num_prompts} prompts but {len(params_list)} sampling params: give one "
                    "SamplingParams for all, or exactly one per prompt"
                )
        # Offline callers want the finished result only: skip building per-step outputs.
        return [p.clone(output_kind=RequestOutputKind.FINAL_ONLY) if isinstance(p, SamplingParams) else p for p in params_list]

    def _add_requests(self, prompts: list[PromptType], params_list: list[SamplingParams], loras: list[LoRARequest | None]) -> list[str]:
        """All or nothing: if one prompt is rejected, the ones already added are aborted."""
        request_ids: list[str] = []
        try:
            for prompt, params, lora_request in zip(prompts, params_list, loras):
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(request_id, prompt, params, lora_request=lora_request)
                request_ids.append(request_id)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise
        return request_ids

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        position = {request_id: i for i, request_id in enumerate(request_ids)}
        results: list[RequestOutput | None] = [None] * len(request_ids)
        progress = _Progress(len(request_ids)) if use_tqdm else None
        try:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished and output.request_id in position:
                        results[position[output.request_id]] = output
                        if progress:
                            progress.update(output)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise
        finally:
            if progress:
                progress.close()
        if self.llm_engine.is_dead:
            num_aborted = sum(1 for r in results if r is not None and r.outputs[0].finish_reason == FinishReason.ABORT.value)
            raise EngineDeadError(f"{num_aborted} request(s) aborted: {self.llm_engine.dead_reason}")
        return results


def _per_prompt(lora_request: Any, num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(loras)} lora requests: give one LoRARequest for all, or exactly one per prompt")
    return loras


class _Progress:
    """vLLM-style bar: prompts done, with input and output tokens per second."""

    def __init__(self, total: int):
        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.num_input_tokens = 0
        self.num_output_tokens = 0

    def update(self, output: RequestOutput) -> None:
        self.num_input_tokens += len(output.prompt_token_ids)
        self.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"est. speed input: {self.num_input_tokens / elapsed:.2f} toks/s, "
            f"output: {self.num_output_tokens / elapsed:.2f} toks/s",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
