"""Offline throughput: pagedserve against Hugging Face `generate`, same weights, same prompts,
one run (like vLLM's benchmark_throughput with the random dataset).

N prompts of random token ids with random input lengths and a fixed output length (ignore_eos).
Hugging Face runs them as a user would: left-padded batches of `--hf-batch-size`, in arrival
order, greedy, exactly `output_len` new tokens. pagedserve gets all prompts at once.

`--model` takes a checkpoint folder instead of the random-weight Llama built to the `--hidden-size`
etc. given. `--modes` runs pagedserve several times on the same prompts, back to back, under other
engine settings (the engine core in this process or its own, one or two torch threads; see MODES),
and reports each one's speedup over the first.

It also measures the engine's own CPU cost per step (schedule + update + the worker's input
preparation, see engine_step_cpu.py) with 256 running requests, on the tiny random-weight model.

    python benchmarks/throughput.py                 # the defaults of benchmarks/results/ (about 7 min here)
    python benchmarks/throughput.py --num-prompts 16 --output-len 8 --skip-overhead   # smoke run
    python benchmarks/throughput.py --model /work/smollm2-hf --dtype bfloat16 --skip-hf --skip-overhead \
        --num-prompts 128 --input-len-min 32 --input-len-max 256 --kv-cache-gib 2 \
        --modes in_process,in_process_1_thread,core_process_1_thread,core_process_2_threads   # the engine core in its own process
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

MODES = {  # name -> engine arguments on top of the run's own
    "in_process": {},  # torch's default threads: the process's cores
    "in_process_1_thread": {"num_cpu_threads": 1},
    "core_process_1_thread": {"engine_core_process": True, "num_cpu_threads": 1},
    "core_process_2_threads": {"engine_core_process": True, "num_cpu_threads": 2},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: a random-weight Llama of the sizes below)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--modes", default="in_process", help=f"comma list of pagedserve runs, of {', '.join(MODES)}")
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
    args = parser.parse_args()
    if unknown := set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; allowed: {', '.join(MODES)}")
    return args


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

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            total += sum(_numel(handle.get_slice(name).get_shape()) for name in handle.keys())
    return total


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


def time_generate(model: str, engine_args: dict, prompts: list[list[int]], output_len: int, then=None) -> tuple[float, float]:
    """(startup + warm-up seconds, seconds) of pagedserve generating exactly `output_len` tokens
    per prompt (greedy, ignore_eos); the time covers generate() only. peers/offline_run.py uses it
    too, with `then(llm)` run on the same engine after the timed run (its output check)."""
    from pagedserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model, **engine_args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
        startup_s = time.perf_counter() - started
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        if then is not None:
            then(llm)
    finally:
        llm.shutdown()
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * output_len
    return startup_s, seconds


def run_pagedserve(folder: Path, prompts: list[list[int]], args: argparse.Namespace, mode: str) -> dict:
    engine_args = {"dtype": args.dtype, "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30), "seed": args.seed, **MODES[mode]}
    _, seconds = time_generate(str(folder), engine_args, prompts, args.output_len)
    return summary(len(prompts), sum(map(len, prompts)), len(prompts) * args.output_len, seconds)


@torch.inference_mode()
def run_hf(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, args.dtype)).eval()
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
    report: dict = {"torch_threads": torch.get_num_threads(), "workload": {k: str(v) for k, v in vars(args).items() if k != "output"}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or build_checkpoint(args, Path(tmp))
        report["model"] = {"parameters_millions": round(count_parameters(folder) / 1e6, 1), "dtype": args.dtype}
        modes = args.modes.split(",")
        runs = {mode: run_pagedserve(folder, prompts, args, mode) for mode in modes}
        report["pagedserve"] = runs[modes[0]]
        if len(modes) > 1:
            report["modes"] = runs
            report[f"speedup_vs_{modes[0]}"] = {m: round(runs[modes[0]]["seconds"] / r["seconds"], 3) for m, r in runs.items()}
        if not args.skip_hf:
            report["huggingface"] = run_hf(folder, prompts, args)
            report["ratio"] = {
                key: round(report["pagedserve"][key] / report["huggingface"][key], 2)
                for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
            }
    if not args.skip_overhead:
        report["engine_overhead"] = measure_engine_overhead()
    common.write_report(report, args.output)

if __name__ == "__main__":
    main()
