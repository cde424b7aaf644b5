"""The ground truth for constrained greedy decoding: Hugging Face logits masked by xgrammar's own
GrammarMatcher, argmax, one token at a time. No pagedserve code here, on purpose."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class GrammarReference:
    """Greedy constrained completions of one tiny checkpoint, cached per (prompt, spec, max_tokens)."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self._setup(model, AutoTokenizer.from_pretrained(str(model_dir)))

    @classmethod
    def of(cls, model, tokenizer) -> GrammarReference:
        """Over a model already loaded (a GGUF's HF load, say) and its tokenizer."""
        reference = cls.__new__(cls)
        reference._setup(model, tokenizer)
        return reference

    def _setup(self, model, tokenizer) -> None:
        import xgrammar as xgr

        self.model = model
        self.vocab_size = self.model.config.vocab_size  # the logits' width, padding included
        eos = self.model.config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(self.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info)
        self.cache: dict[tuple, list[int]] = {}

    def compile(self, kind: str, value, any_whitespace: bool = False):
        """The same spec the engine gets, compiled by xgrammar directly (vLLM's mapping: compact
        JSON is vLLM's disable_any_whitespace, no whitespace even after "," and ":")."""
        layout = {"any_whitespace": any_whitespace, "separators": None if any_whitespace else (",", ":")}
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(value), **layout)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', **layout)
        if kind == "regex":
            return self.compiler.compile_regex(value)
        if kind == "choice":
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in value))
        assert kind == "grammar"
        return self.compiler.compile_grammar(value)

    @torch.inference_mode()
    def greedy(self, prompt_token_ids: list[int], kind: str, value, max_tokens: int) -> list[int]:
        import xgrammar as xgr

        key = (tuple(prompt_token_ids), kind, json.dumps(value), max_tokens)
        if key in self.cache:
            return self.cache[key]
        matcher = xgr.GrammarMatcher(self.compile(kind, value))
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        input_ids = torch.tensor([prompt_token_ids])
        past, outputs = None, []
        for _ in range(max_tokens):
            result = self.model(input_ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            logits = result.logits[:, -1, :].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token_id = int(logits.argmax(dim=-1))
            outputs.append(token_id)
            assert matcher.accept_token(token_id)
            if matcher.is_terminated() or token_id in self.eos_token_ids:
                break
            input_ids = torch.tensor([[token_id]])
        self.cache[key] = outputs
        return outputs

    @torch.inference_mode()
    def masked_logprobs(self, prompt_token_ids: list[int], kind: str, value, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab]: at each position (teacher-forced on `token_ids`), the log-softmax
        of HF's logits masked by the matcher: what a constrained request's logprobs must equal."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(kind, value))
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        logits = self.model(torch.tensor([prompt_token_ids + token_ids[:-1]])).logits[0, len(prompt_token_ids) - 1 :].float()
        for position, token_id in enumerate(token_ids):
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits[position : position + 1], bitmask)
            assert matcher.accept_token(token_id)
        return torch.log_softmax(logits, dim=-1)
