"""Offline throughput: pagedserve against Hugging Face `generate`, same weights, same prompts,
one run (like vLLM's benchmark_throughput with the random dataset).

N prompts of random token ids with random input lengths and a fixed output length (ignore_eos).
Hugging Face runs them as a user would: left-padded batches of `--hf-batch-size`, in arrival
order, greedy, exactly `output_len` new tokens. pagedserve gets all prompts at once.

It also measures the engine's own CPU cost per step (schedule + update + the worker's input
preparation, see engine_step_cpu.py) with 256 running requests, on the tiny random-weight model.

    python benchmarks/throughput.py                 # the defaults of benchmarks/results/ (about 7 min here)
    python benchmarks/throughput.py --num-prompts 16 --output-len 8 --skip-overhead   # smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len-min", type=int, default=16)
    parser.add_argument("--input-len-max", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    return parser.parse_args()


def build_checkpoint(args: argparse.Namespace, folder: Path) -> Path:
    """A random-weight Llama checkpoint of the requested size, with the demo tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(folder)
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.input_len_max + args.output_len + 16,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(args.seed)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


def count_parameters(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return sum(_numel(handle.get_slice(name).get_shape()) for name in handle.keys())


def _numel(shape: list[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def random_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.input_len_min, args.input_len_max) for _ in range(args.num_prompts)]
    return [[rng.randint(10, 500) for _ in range(n)] for n in lengths]


def summary(num_prompts: int, num_input: int, num_output: int, seconds: float) -> dict:
    return {
        "seconds": round(seconds, 2),
        "requests_per_s": round(num_prompts / seconds, 3),
        "output_tokens_per_s": round(num_output / seconds, 1),
        "total_tokens_per_s": round((num_input + num_output) / seconds, 1),
    }


def run_pagedserve(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(folder), kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), seed=args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.shutdown()
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_output == len(prompts) * args.output_len
    return summary(len(prompts), sum(map(len, prompts)), num_output, seconds)


@torch.inference_mode()
def run_hf(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    batches = [prompts[i : i + args.hf_batch_size] for i in range(0, len(prompts), args.hf_batch_size)]
    _hf_generate(model, batches[0][:2], 4, pad)  # warm-up
    start = time.perf_counter()
    num_output = sum(_hf_generate(model, batch, args.output_len, pad) for batch in batches)
    seconds = time.perf_counter() - start
    return summary(len(prompts), sum(map(len, prompts)), num_output, seconds)


def _hf_generate(model, batch: list[list[int]], output_len: int, pad: int) -> int:
    width = max(map(len, batch))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=output_len,
        min_new_tokens=output_len,  # HF's way to ignore EOS
        do_sample=False,
        pad_token_id=pad,
    )
    return (out.shape[1] - width) * len(batch)


def measure_engine_overhead(num_requests: int = 256, steps: int = 30) -> dict:
    """CPU milliseconds per decode step spent outside the model with `num_requests` running
    (engine_step_cpu.py's parts: schedule, update, the worker's input and sampling preparation;
    detokenization apart). That script also compares against a baseline commit."""
    from engine_step_cpu import measure_engine_cpu, summarize

    return {"running_requests": num_requests, "median_cpu_ms_per_step": summarize(measure_engine_cpu(num_requests, steps))}


def main() -> None:
    args = parse_args()
    prompts = random_prompts(args)
    report: dict = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads()},
        "workload": {k: v for k, v in vars(args).items() if k != "output"},
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_checkpoint(args, Path(tmp))
        report["model"] = {"parameters_millions": round(count_parameters(folder) / 1e6, 1), "dtype": "float32"}
        report["pagedserve"] = run_pagedserve(folder, prompts, args)
        if not args.skip_hf:
            report["huggingface"] = run_hf(folder, prompts, args)
            report["ratio"] = {
                key: round(report["pagedserve"][key] / report["huggingface"][key], 2)
                for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
            }
    if not args.skip_overhead:
        report["engine_overhead"] = measure_engine_overhead()
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
