"""GPU decode benchmark: step time against the HBM roofline, offline throughput against Hugging
Face `generate`, and attention kernel times, for a random-weight model with Llama-3.2-1B's shapes.

1. Decode step time at batch 1, 32 and 256 (every sequence `--context-len` tokens deep), per
   attention backend, next to the roofline: (weight bytes + KV bytes read per step) / bandwidth.
   A decode step must read every weight once and each sequence's whole KV cache, so no step can
   be faster; `roofline_fraction` says how close the engine gets.
2. Offline throughput: the same random prompts through pagedserve and through HF `generate`
   (left-padded batches, greedy, ignore EOS) on the same GPU, in the same dtype.
3. Kernel times: one layer's paged attention for decode and prefill batches, Triton against the
   torch reference (and flash-attn's paged API when installed, at its 256-token pages).

Prints JSON (with the device's name); `--output` also writes it to a file. On a machine without
a GPU, `--dry-run` runs every part at toy sizes on the CPU (torch backend), to check the script.

    python benchmarks/gpu_decode.py --output benchmarks/results/gpu_decode_<device>.json
    python benchmarks/gpu_decode.py --dry-run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import random
import statistics
import tempfile
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json), random weights.
LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
)
TOY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
# Peak HBM bandwidth in GB/s by device-name fragment (vendor datasheets); first match wins.
BANDWIDTH_GBS = [
    ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIe", 1935), ("A100", 1555), ("L40S", 864), ("L4", 300), ("A10G", 600), ("RTX 4090", 1008),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 256])
    parser.add_argument("--context-len", type=int, default=512, help="KV tokens per sequence during decode")
    parser.add_argument("--decode-steps", type=int, default=50, help="timed decode steps per batch size")
    parser.add_argument("--backends", default="triton,triton-eager,torch",
                        help="comma list of triton (CUDA graphs), triton-eager, torch, flash_attn; the suffix "
                             "-unfused keeps the layers' torch ops where CUDA has fused kernels (kernels/cuda_layers)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--bandwidth-gbs", type=float, help="HBM bandwidth; default: looked up by device name")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the timed steps, this many more under cProfile: where a step's host time goes")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU, to check the script")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.batch_sizes, args.context_len, args.decode_steps = [1, 4], 24, 3
        args.backends, args.num_prompts, args.input_len, args.output_len, args.hf_batch_size = "torch", 4, 16, 4, 2
        args.profile_steps = min(args.profile_steps, 2)
    return args


def device_info(args: argparse.Namespace) -> dict:
    if args.dry_run or not torch.cuda.is_available():
        return {"device": "cpu", "bandwidth_gbs": args.bandwidth_gbs}
    name = torch.cuda.get_device_name()
    bandwidth = args.bandwidth_gbs or next((gbs for key, gbs in BANDWIDTH_GBS if key in name), None)
    return {"device": name, "bandwidth_gbs": bandwidth, "torch": torch.__version__, "cuda": torch.version.cuda}


def build_checkpoint(shape: dict, max_positions: int, folder: Path) -> Path:
    """Random weights (bfloat16 on disk) with the demo tokenizer; prompts are random token ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(folder)
    config = LlamaConfig(**shape, max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(folder))
    return folder


def engine_kwargs(backend: str, args: argparse.Namespace) -> dict:
    backend = backend.removesuffix("-unfused")
    kwargs = {"attention_backend": backend.removesuffix("-eager"), "enforce_eager": backend.endswith("-eager")}
    if backend == "flash_attn":
        kwargs["block_size"] = 256  # flash-attn's smallest paged block
    if args.dry_run:
        kwargs |= {"device": "cpu", "dtype": "float32"}
    return kwargs


# ---- 1. decode step time against the roofline -----------------------------------------------


def measure_decode(folder: Path, backend: str, args: argparse.Namespace, info: dict) -> list[dict]:
    from pagedserve.kernels import cuda_layers

    # -unfused: the layers' torch ops, as before the fused kernels
    unfused = mock.patch.object(cuda_layers, "can_fuse", lambda x: False)
    with unfused if backend.endswith("-unfused") else contextlib.nullcontext():
        return _measure_decode(folder, backend, args, info)


def _measure_decode(folder: Path, backend: str, args: argparse.Namespace, info: dict) -> list[dict]:
    from pagedserve import LLM, SamplingParams

    max_len = args.context_len + args.decode_steps + args.profile_steps + 8
    llm = LLM(str(folder), max_num_seqs=max(args.batch_sizes), max_model_len=max_len,
              max_num_batched_tokens=max(8192, max_len), **engine_kwargs(backend, args))
    engine, rows = llm.llm_engine, []
    runner = engine.engine_core.engine_core.executor.worker.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())  # tied: once
    kv_bytes_per_token = runner.kv_cache_bytes_per_block() // engine.config.block_size  # all layers
    try:
        for batch in args.batch_sizes:
            steps = args.decode_steps + args.profile_steps
            params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
            rng = random.Random(batch)
            for i in range(batch):
                prompt = [rng.randint(10, 500) for _ in range(args.context_len)]
                engine.add_request(f"{batch}-{i}", {"prompt_token_ids": prompt}, params)
            while engine.engine_core.engine_core.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.engine_core.engine_core.scheduler.running):
                engine.step()  # prefill every sequence first: the figure is for steady decoding
            times = [_timed(engine.step) for _ in range(args.decode_steps)]
            profile = _host_profile(engine.step, args.profile_steps) if args.profile_steps else None
            while engine.has_unfinished_requests():
                engine.step()
            step_ms = statistics.median(times) * 1e3
            # Each step reads every sequence's whole context; it grows by one token per step.
            kv_bytes = batch * (args.context_len + args.decode_steps // 2) * kv_bytes_per_token
            rows.append(_roofline_row(backend, batch, step_ms, weight_bytes, kv_bytes, info["bandwidth_gbs"]))
            if profile:
                rows[-1]["host_profile"] = profile
    finally:
        llm.shutdown()
    return rows


def _host_profile(step, steps: int, top: int = 25) -> dict:
    """The functions under `steps` engine steps, by cumulative and by own time, in ms per step
    (cProfile's overhead included). A call that waits for the GPU (the sampled tokens' copy back)
    shows the device time the host could not hide."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    _sync()
    profiler.runcall(lambda: [step() for _ in range(steps)])
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, callers)
    rows = [{"function": f"{Path(file).name}:{line}({name})", "calls_per_step": round(nc / steps, 1),
             "cum_ms": round(cum / steps * 1e3, 3), "self_ms": round(tot / steps * 1e3, 3)}
            for (file, line, name), (_, nc, tot, cum, _) in stats.items()
            if Path(file).name != Path(__file__).name]  # the lambda above, not the engine
    return {"steps": steps, "by_cumulative": sorted(rows, key=lambda r: -r["cum_ms"])[:top],
            "by_self": sorted(rows, key=lambda r: -r["self_ms"])[:top]}


def _timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _roofline_row(backend: str, batch: int, step_ms: float, weight_bytes: int, kv_bytes: int, bandwidth_gbs) -> dict:
    row = {"backend": backend, "batch": batch, "step_ms": round(step_ms, 3),
           "tokens_per_s": round(batch / step_ms * 1e3, 1), "weight_gb": round(weight_bytes / 1e9, 3),
           "kv_gb_read": round(kv_bytes / 1e9, 3)}
    if bandwidth_gbs:
        roofline_ms = (weight_bytes + kv_bytes) / (bandwidth_gbs * 1e9) * 1e3
        row |= {"roofline_ms": round(roofline_ms, 3), "roofline_fraction": round(roofline_ms / step_ms, 3)}
    return row


# ---- 2. offline throughput against Hugging Face generate ------------------------------------


def measure_throughput(folder: Path, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randint(10, 500) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    num_output = args.num_prompts * args.output_len
    backend = args.backends.split(",")[0]
    engine_s = _run_pagedserve(folder, prompts, backend, args)
    hf_s = _run_hf(folder, prompts, args)
    result = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "backend": backend, "pagedserve_output_tokens_per_s": round(num_output / engine_s, 1),
              "hf_output_tokens_per_s": round(num_output / hf_s, 1), "hf_batch_size": args.hf_batch_size}
    result["speedup"] = round(hf_s / engine_s, 2)
    return result


def _run_pagedserve(folder: Path, prompts: list[list[int]], backend: str, args: argparse.Namespace) -> float:
    """Seconds for `generate` over all prompts, after a warm-up (engine start-up not timed)."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(folder), max_model_len=args.input_len + args.output_len + 8, **engine_kwargs(backend, args))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    try:
        llm.generate(requests[:2], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        _sync()
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        _sync()
        seconds = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * args.output_len
    finally:
        llm.shutdown()
    return seconds


@torch.inference_mode()
def _run_hf(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """Seconds for HF `generate` over all prompts, after a warm-up batch (model load not timed)."""
    from transformers import AutoModelForCausalLM

    device, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    batches = [prompts[i : i + args.hf_batch_size] for i in range(0, len(prompts), args.hf_batch_size)]
    _hf_generate(model, batches[0][:2], 2, device)
    return sum(_timed(lambda b=b: _hf_generate(model, b, args.output_len, device)) for b in batches)


def _hf_generate(model, batch: list[list[int]], output_len: int, device: str) -> None:
    pad = model.config.pad_token_id
    width = max(map(len, batch))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                   do_sample=False, pad_token_id=pad)


# ---- 3. attention kernel times ------------------------------------------------------------------


def measure_kernels(shape: dict, args: argparse.Namespace) -> list[dict]:
    """One layer's attention (this step's K/V already written) for decode and prefill batches."""
    device, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    batches = [(f"decode_b{b}", [1] * b, [args.context_len - 1] * b) for b in args.batch_sizes]
    batches.append(("prefill_4x512" if not args.dry_run else "prefill_2x8", *_prefill_lengths(args.dry_run)))
    rows = []
    for name, query_lens, context_lens in batches:
        for backend, block_size in _kernel_backends(args.dry_run):
            meta, cache = _random_paged_batch(query_lens, context_lens, kv_heads, head_dim, block_size, dtype, device, backend)
            # Timing only: this step's K/V need not match the cache (the reference reads them
            # for chunks with no cached context, the others read the cache).
            q, k, v = (torch.randn(sum(query_lens), n, head_dim, dtype=dtype, device=device) for n in (heads, kv_heads, kv_heads))
            attention = _attention_fn(backend, device)
            ms = _kernel_ms(lambda: attention(q, k, v, cache, meta, head_dim**-0.5), device)
            rows.append({"batch": name, "backend": backend, "block_size": block_size, "ms": round(ms, 4)})
    return rows


def _prefill_lengths(dry_run: bool) -> tuple[list[int], list[int]]:
    return ([8, 8], [0, 8]) if dry_run else ([512] * 4, [0, 0, 512, 1024])


def _kernel_backends(dry_run: bool) -> list[tuple[str, int]]:
    if dry_run:
        return [("torch", 16)]
    backends = [("triton", 16), ("torch", 16)]
    if importlib.util.find_spec("flash_attn") is not None:
        backends.append(("flash_attn", 256))
    return backends


def _attention_fn(backend: str, device: str):
    from pagedserve.kernels import get_attention_backend

    return get_attention_backend(backend, device).paged_attention


def _random_paged_batch(query_lens, context_lens, kv_heads, head_dim, block_size, dtype, device, backend):
    from pagedserve.kernels import AttentionMetadata
    from pagedserve.kernels import flash_attn as flash_layout
    from pagedserve.kernels import reference

    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(blocks)).to(torch.int32)  # blocks scattered, as after churn
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    offsets = [0]
    for i, n in enumerate(blocks):
        table[i, :n] = order[offsets[-1] : offsets[-1] + n]
        offsets.append(offsets[-1] + n)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    layout = flash_layout.kv_cache_shape if backend == "flash_attn" else reference.kv_cache_shape
    cache = torch.randn(layout(sum(blocks), block_size, kv_heads, head_dim), dtype=dtype, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=table.to(device),
        num_decodes=sum(1 for q in query_lens if q == 1), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_host=qsl, seq_lens_host=seq_lens,
    )
    return meta, cache


def _kernel_ms(fn, device: str, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    if device == "cpu":
        return statistics.median(_timed(fn) for _ in range(repeats)) * 1e3
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU (use --dry-run to check the script on a CPU)")
    shape = TOY if args.dry_run else LLAMA_3_2_1B
    info = device_info(args)
    result = {**info, "model": "toy" if args.dry_run else "Llama-3.2-1B shapes, random weights",
              "context_len": args.context_len, "dtype": "float32" if args.dry_run else "bfloat16"}
    with tempfile.TemporaryDirectory() as tmp:
        max_positions = max(args.context_len + args.decode_steps, args.input_len + args.output_len) + 64
        folder = build_checkpoint(shape, max_positions, Path(tmp))
        result["decode"] = [row for b in args.backends.split(",") for row in measure_decode(folder, b, args, info)]
        if not args.skip_throughput:
            result["throughput"] = measure_throughput(folder, args)
    if not args.skip_kernels:
        result["kernels"] = measure_kernels(shape, args)
    common.write_report(result, args.output, argv)
    return result


if __name__ == "__main__":
    main()
