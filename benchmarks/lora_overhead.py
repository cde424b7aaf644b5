"""LoRA's cost in pagedserve, offline: output throughput of one batch of prompts on the base model
(LoRA off, and LoRA on with no adapter in the batch) against the same batch spread over 1, 4 and
16 adapters, each of rank `--ranks` on every linear layer (PEFT-made, random non-zero B), all in
one run, with the prefix cache off (the runs repeat prompts). `ratio_to_paired_base` takes each
adapter run against a base-model run of the same engine just before it; `ratio_to_base_lora_off`
against one run with LoRA off, at the start. The issue's goal: with 4 adapters, at least 0.8x
the base model's throughput.

    python benchmarks/lora_overhead.py --output benchmarks/results/lora_overhead_cpu.json
    python benchmarks/lora_overhead.py --num-prompts 8 --output-len 8 --adapters 1   # smoke run

Default model: the demo's SmolLM2-135M-Instruct (converted from its GGUF under the cache), bf16.
Not measured here: the comparison with `vllm serve --enable-lora`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapters(model: str, count: int, rank: int, folder: Path) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    paths = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.data = torch.randn(param.shape, generator=generator) * 0.01
        paths.append(folder / f"r{rank}-{index}")
        peft_model.save_pretrained(str(paths[-1]))
    return paths


def timed_run(llm, prompts: list[list[int]], params, loras: list) -> dict:
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds}


def run(args: argparse.Namespace) -> dict:
    from pagedserve import LLM, LoRARequest, SamplingParams

    model = args.model or str(__import__("pagedserve.demo", fromlist=["ensure_demo_model"]).ensure_demo_model())
    prompts = common.random_token_prompts(args.num_prompts, args.input_len_min, args.input_len_max, vocab=(100, 40_000))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # Without the prefix cache: every run sends the same prompts, and a run would reuse the KV of
    # an earlier run's prompts under the same adapter (with 4 adapters, the quarter of the prompts
    # that had adapter 0 with 1 adapter).
    engine = {"dtype": args.dtype, "max_model_len": 1024, "kv_cache_memory_bytes": int(args.kv_cache_gib * 1024**3), "enable_prefix_caching": False}
    results: dict = {}
    base = LLM(model, **engine)
    timed_run(base, prompts[:4], params, None)  # warm-up
    results["base_lora_off"] = timed_run(base, prompts, params, None)
    base.shutdown()
    paired: dict[str, float] = {}
    max_adapters = max(args.adapters)
    with tempfile.TemporaryDirectory() as folder:
        for rank in args.ranks:
            paths = build_adapters(model, max_adapters, rank, Path(folder))
            adapters = [LoRARequest(f"r{rank}-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
            llm = LLM(model, enable_lora=True, max_loras=min(max_adapters, args.max_loras), max_lora_rank=max(args.ranks), **engine)
            timed_run(llm, prompts[:4], params, None)
            results[f"r{rank}_lora_on_no_adapter"] = timed_run(llm, prompts, params, None)
            for count in args.adapters:
                loras = [adapters[i % count] for i in range(len(prompts))]
                timed_run(llm, prompts[:count], params, loras[:count])  # loads them: not timed
                # The same engine's base model just before: the machine's speed drifts by 10%
                # over minutes, more than the ratios this measures.
                base_now = timed_run(llm, prompts, params, None)
                results[f"r{rank}_{count}_adapters"] = timed_run(llm, prompts, params, loras)
                paired[f"r{rank}_{count}_adapters"] = round(results[f"r{rank}_{count}_adapters"]["output_tok_s"] / base_now["output_tok_s"], 3)
            llm.shutdown()
    base_rate = results["base_lora_off"]["output_tok_s"]
    ratios = {name: round(r["output_tok_s"] / base_rate, 3) for name, r in results.items()}
    return {"model": model, "settings": vars(args), "results": results, "ratio_to_base_lora_off": ratios, "ratio_to_paired_base": paired}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint folder (default: the demo's SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-min", type=int, default=32)
    parser.add_argument("--input-len-max", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--ranks", type=lambda text: [int(r) for r in text.split(",")], default=[8, 16])
    parser.add_argument("--adapters", type=lambda text: [int(a) for a in text.split(",")], default=[1, 4, 16])
    parser.add_argument("--max-loras", type=int, default=16, help="adapter slots (max_loras)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--output", help="write the JSON report here")
    args = parser.parse_args()
    common.write_report(run(args), args.output)


if __name__ == "__main__":
    main()
