"""Tensor and pipeline parallelism on real Ray actors with gloo: exact outputs, dead workers,
load failures. Every case is compared with Hugging Face (and so with TP=1, which matches it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.llm_engine import EngineDeadError
from tests.models import HFReference, build_model

PROMPTS = [
    "Hello, my name is",
    "The capital of France is Paris. The capital of Japan is",
    "Once upon a time there was a small server in a quiet data center. It answered questions.",
    "café naïve 日本語 🙂",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def parallel_models(artifacts, tokenizer_dir, model_dirs):
    """Checkpoints chosen for what they stress in a split model."""
    folders = {
        # 3 layers: PP=2 splits them unevenly (2 + 1).
        "llama_3_layers": build_model(artifacts / "llama3l", "llama", tokenizer_dir, num_hidden_layers=3),
        # One KV head (MQA): with TP=2 each rank holds a replica of it.
        "mistral_mqa": model_dirs["mistral"],
        # Tied embeddings and an odd vocabulary (579 rows): the vocab-parallel shards are uneven.
        "qwen2_tied_odd_vocab": build_model(artifacts / "qwen2odd", "qwen2", tokenizer_dir, vocab_size=579),
        "qwen3": model_dirs["qwen3"],
    }
    return {name: (folder, HFReference(folder)) for name, folder in folders.items()}


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def assert_matches_hf(llm: LLM, hf: HFReference, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> None:
    for output in llm.generate(prompts, greedy(max_tokens), use_tqdm=False):
        assert output.outputs[0].token_ids == hf.greedy(output.prompt_token_ids, max_tokens), output.prompt


@pytest.mark.parametrize(
    "model, tp, pp",
    [
        ("qwen3", 2, 1),
        ("llama_3_layers", 1, 2),
        ("llama_3_layers", 2, 2),
        ("mistral_mqa", 2, 1),
        ("qwen2_tied_odd_vocab", 2, 1),
        ("qwen2_tied_odd_vocab", 1, 2),
    ],
)
def test_parallel_greedy_matches_hf(ray_cluster, parallel_models, model, tp, pp):
    folder, hf = parallel_models[model]
    llm = LLM(str(folder), max_model_len=256, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        assert llm.llm_engine.engine_core.engine_core.executor.world_size == tp * pp
        assert_matches_hf(llm, hf)
    finally:
        llm.shutdown()


def test_each_rank_binds_its_thread_to_its_own_cpu(ray_cluster, parallel_models):
    """`cpu_omp_threads_bind` with a CPU list per rank ('0|1', vLLM's form): each TP rank's torch
    thread (one a rank: Ray gives each one CPU) runs on its rank's CPU alone, every other thread
    of the rank on every CPU; greedy output stays Hugging Face's."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two ranks on CPUs of their own need two CPUs")
    folder, hf = parallel_models["qwen3"]
    llm = LLM(str(folder), max_model_len=256, tensor_parallel_size=2, cpu_omp_threads_bind=f"{cpus[1]}|{cpus[0]}")
    try:
        assert_matches_hf(llm, hf)
        pids = llm.llm_engine.engine_core.engine_core.executor.worker_pids()
        masks = [[sorted(os.sched_getaffinity(int(task))) for task in os.listdir(f"/proc/{pid}/task")] for pid in pids]
    finally:
        llm.shutdown()
    for rank, cpu in enumerate([cpus[1], cpus[0]]):
        assert [mask for mask in masks[rank] if len(mask) == 1] == [[cpu]], masks[rank]
        assert all(mask == cpus for mask in masks[rank] if len(mask) > 1), masks[rank]


def long_batch(llm: LLM, num_prompts: int = 8, max_tokens: int = 40) -> list[str]:
    ids = []
    for i in range(num_prompts):
        request_id = f"long-{i}"
        llm.llm_engine.add_request(request_id, PROMPTS[i % len(PROMPTS)] + f" {i}", greedy(max_tokens))
        ids.append(request_id)
    return ids


def run_to_completion(llm: LLM, on_step=None) -> dict[str, list[int]]:
    results, step = {}, 0
    while llm.llm_engine.has_unfinished_requests():
        for output in llm.llm_engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        step += 1
        if on_step:
            on_step(step)
    return results


def test_sigkill_of_a_worker_is_survived(ray_cluster, parallel_models):
    folder, hf = parallel_models["qwen3"]
    llm = LLM(str(folder), max_model_len=256, tensor_parallel_size=2)
    try:
        ids = long_batch(llm)
        prompts = {r.request_id: r.prompt_token_ids for r in llm.llm_engine.engine_core.engine_core.scheduler.requests.values()}
        victim = llm.llm_engine.engine_core.engine_core.executor.worker_pids()[1]

        def kill_mid_batch(step: int) -> None:
            if step == 10:
                os.kill(victim, signal.SIGKILL)

        results = run_to_completion(llm, kill_mid_batch)
        assert llm.llm_engine.engine_core.engine_core.num_worker_restarts == 1
        assert victim not in llm.llm_engine.engine_core.engine_core.executor.worker_pids()
        for request_id in ids:
            assert results[request_id] == hf.greedy(prompts[request_id], 40), request_id
        assert_matches_hf(llm, hf)  # and it keeps serving
    finally:
        llm.shutdown()


def test_sigkill_during_a_step(ray_cluster, parallel_models):
    """The kill lands after a step was sent, while the engine waits for the replies."""
    folder, hf = parallel_models["llama_3_layers"]
    llm = LLM(str(folder), max_model_len=256, pipeline_parallel_size=2)
    try:
        executor = llm.llm_engine.engine_core.engine_core.executor
        victim = executor.worker_pids()[0]
        collect, calls = executor._collect_replies, []

        def collect_with_kill():
            calls.append(1)
            if len(calls) == 6:
                os.kill(victim, signal.SIGKILL)
            return collect()

        executor._collect_replies = collect_with_kill
        outputs = llm.generate(PROMPTS * 4, greedy(48), use_tqdm=False)
        assert llm.llm_engine.engine_core.engine_core.num_worker_restarts == 1
        assert llm.llm_engine.engine_core.engine_core.executor is not executor
        for output in outputs:
            assert output.outputs[0].token_ids == hf.greedy(output.prompt_token_ids, 48)
    finally:
        llm.shutdown()


def test_worker_that_raises_is_replaced(ray_cluster, parallel_models):
    folder, hf = parallel_models["mistral_mqa"]
    llm = LLM(str(folder), max_model_len=256, tensor_parallel_size=2)
    try:
        ids = long_batch(llm, num_prompts=4, max_tokens=24)
        prompts = {r.request_id: r.prompt_token_ids for r in llm.llm_engine.engine_core.engine_core.scheduler.requests.values()}
        import ray

        worker = llm.llm_engine.engine_core.engine_core.executor.workers[0]

        def break_worker(step: int) -> None:
            if step == 5:  # the next step raises inside the actor (its runner is gone)
                ray.get(worker.__ray_call__.remote(lambda self: setattr(self, "runner", None)))

        results = run_to_completion(llm, break_worker)
        assert llm.llm_engine.engine_core.engine_core.num_worker_restarts == 1
        for request_id in ids:
            assert results[request_id] == hf.greedy(prompts[request_id], 24)
    finally:
        llm.shutdown()


def _wedge_next_step(worker) -> None:
    """Run inside the actor (via __ray_call__): its next step never returns, as a rank stuck in a
    collective or a kernel would; the process stays alive and Ray sees nothing wrong."""
    worker.execute_model = lambda scheduler_output: time.sleep(3600)


def test_wedged_worker_is_replaced_after_step_timeout(ray_cluster, parallel_models):
    folder, hf = parallel_models["qwen3"]
    llm = LLM(str(folder), max_model_len=256, tensor_parallel_size=2, step_timeout_s=10.0)
    try:
        ids = long_batch(llm, num_prompts=4, max_tokens=24)
        prompts = {r.request_id: r.prompt_token_ids for r in llm.llm_engine.engine_core.engine_core.scheduler.requests.values()}
        import ray

        executor = llm.llm_engine.engine_core.engine_core.executor
        wedged_pid = executor.worker_pids()[1]

        def wedge(step: int) -> None:
            if step == 5:
                ray.get(executor.workers[1].__ray_call__.remote(_wedge_next_step))

        results = run_to_completion(llm, wedge)
        assert llm.llm_engine.engine_core.engine_core.num_worker_restarts == 1
        assert wedged_pid not in llm.llm_engine.engine_core.engine_core.executor.worker_pids()
        for request_id in ids:
            assert results[request_id] == hf.greedy(prompts[request_id], 24), request_id
    finally:
        llm.shutdown()


# Run with no Ray started beforehand, and os.cpu_count() pinned to 2 so the case holds on any
# machine: resolving the config must not start a 2-CPU Ray that 4 ranks then cannot fit into.
FEWER_CORES_THAN_RANKS = """
import json, os, sys
os.cpu_count = lambda: 2
import ray
from pagedserve import LLM, SamplingParams
prompts = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], max_model_len=256, tensor_parallel_size=2, pipeline_parallel_size=2)
outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3])), use_tqdm=False)
print(json.dumps([[o.prompt_token_ids, o.outputs[0].token_ids] for o in outputs]))
llm.shutdown()
ray.shutdown()
"""


def test_tp2_pp2_starts_ray_itself_on_fewer_cores_than_ranks(parallel_models):
    folder, hf = parallel_models["llama_3_layers"]
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-c", FEWER_CORES_THAN_RANKS, str(folder), json.dumps(PROMPTS), str(MAX_TOKENS)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(outputs) == len(PROMPTS)
    for prompt_token_ids, token_ids in outputs:
        assert token_ids == hf.greedy(prompt_token_ids, MAX_TOKENS)


def test_group_that_cannot_be_rebuilt_aborts_and_raises(ray_cluster, parallel_models):
    folder, _ = parallel_models["qwen3"]
    llm = LLM(str(folder), max_model_len=256, tensor_parallel_size=2, max_worker_restarts=0)
    try:
        victim = llm.llm_engine.engine_core.engine_core.executor.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(EngineDeadError, match="4 request\\(s\\) aborted.*failed 1 times in a row"):
            llm.generate(PROMPTS, greedy(), use_tqdm=False)
        with pytest.raises(EngineDeadError):
            llm.generate("Hello", greedy(), use_tqdm=False)
        assert not alive_workers(ray_cluster)
    finally:
        llm.shutdown()


def test_abort_outputs_when_the_engine_dies(ray_cluster, parallel_models):
    folder, _ = parallel_models["qwen3"]
    llm = LLM(str(folder), max_model_len=256, tensor_parallel_size=2, max_worker_restarts=0)
    try:
        ids = long_batch(llm, num_prompts=3)
        llm.llm_engine.step()
        os.kill(llm.llm_engine.engine_core.engine_core.executor.worker_pids()[1], signal.SIGKILL)
        finals = {}
        while llm.llm_engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in llm.llm_engine.step() if o.finished})
        assert set(finals) == set(ids)
        assert {o.outputs[0].finish_reason for o in finals.values()} == {"abort"}
        assert llm.llm_engine.is_dead
    finally:
        llm.shutdown()


def _step_size(num_prompt_tokens: int, req_id: str) -> int:
    """The pickled size of a step that schedules one new request of that many prompt tokens."""
    import pickle

    from pagedserve.step_types.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

    new = NewRequestData(req_id, [300] * num_prompt_tokens, num_prompt_tokens, greedy().sampler_params(), list(range(16)), 0)
    step = SchedulerOutput([new], CachedRequestData(), {req_id: num_prompt_tokens}, num_prompt_tokens, set())
    return len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))


def test_step_over_the_channel_limit_is_split_not_a_dead_worker(ray_cluster, parallel_models, monkeypatch):
    """Issue 19's poison batch: a step past the channel's size limit was taken for a dead worker,
    rebuilt and resent until the engine died. Now it runs in parts; a request too large even
    alone is ended ("error", saying why) while the others finish exactly; no worker restarts."""
    from pagedserve.workers import step_channel

    folder, hf = parallel_models["qwen3"]
    llm = LLM(str(folder), max_model_len=256, tensor_parallel_size=2, max_worker_restarts=0)
    try:
        # Each 120-token prompt fits alone, no two do; the 250-token one does not fit at all.
        monkeypatch.setattr(step_channel, "MAX_MESSAGE_BYTES", _step_size(120, "fits-0") + 100)
        assert 2 * _step_size(120, "fits-0") > step_channel.MAX_MESSAGE_BYTES + 300
        prompts = {f"fits-{i}": [256 + (7 * i + j) % 250 for j in range(120)] for i in range(4)}
        prompts["too-large"] = [300 + j % 200 for j in range(250)]
        for request_id, token_ids in prompts.items():
            llm.llm_engine.add_request(request_id, {"prompt_token_ids": token_ids}, greedy(8))
        finals = {}
        while llm.llm_engine.has_unfinished_requests():
            finals.update({o.request_id: o.outputs[0] for o in llm.llm_engine.step() if o.finished})
        assert set(finals) == set(prompts)
        assert finals["too-large"].finish_reason == "error" and finals["too-large"].token_ids == []
        assert "too large to send to the workers" in finals["too-large"].error
        for i in range(4):
            assert finals[f"fits-{i}"].token_ids == hf.greedy(prompts[f"fits-{i}"], 8), i
        assert llm.llm_engine.engine_core.engine_core.num_worker_restarts == 0 and not llm.llm_engine.is_dead
        monkeypatch.undo()
        assert_matches_hf(llm, hf)  # and it keeps serving
    finally:
        llm.shutdown()


def test_load_failure_leaves_no_actors_or_placement_groups(ray_cluster, parallel_models, tmp_path):
    import shutil

    folder = tmp_path / "corrupt"
    shutil.copytree(parallel_models["qwen3"][0], folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(Exception, match="cannot read weights from"):
        LLM(str(folder), max_model_len=256, tensor_parallel_size=2)
    deadline = time.monotonic() + 10
    while (alive_workers(ray_cluster) or live_placement_groups(ray_cluster)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive_workers(ray_cluster)
    assert not live_placement_groups(ray_cluster)


def test_shutdown_releases_actors_and_placement_group(ray_cluster, parallel_models):
    llm = LLM(str(parallel_models["qwen3"][0]), max_model_len=256, tensor_parallel_size=2)
    assert len(alive_workers(ray_cluster)) == 2
    llm.shutdown()
    deadline = time.monotonic() + 10
    while (alive_workers(ray_cluster) or live_placement_groups(ray_cluster)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive_workers(ray_cluster) and not live_placement_groups(ray_cluster)


def alive_workers(ray) -> list:
    from ray.util.state import list_actors

    return list_actors(address=own_cluster(ray), filters=[("class_name", "=", "Worker"), ("state", "=", "ALIVE")])


def live_placement_groups(ray) -> list:
    from ray.util.state import list_placement_groups

    return [pg for pg in list_placement_groups(address=own_cluster(ray)) if pg.state != "REMOVED"]


def own_cluster(ray) -> str:
    """This session's GCS address: the state API otherwise looks for "the" local Ray and refuses
    when other clusters run on the same machine."""
    return ray.get_runtime_context().gcs_address


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_workers_and_engine_use_no_cpu(ray_cluster, parallel_models):
    """Workers block in recv and the engine in select: an idle engine costs no CPU."""
    llm = LLM(str(parallel_models["qwen3"][0]), max_model_len=256, tensor_parallel_size=2)
    try:
        llm.generate(PROMPTS, greedy(4), use_tqdm=False)
        pids = llm.llm_engine.engine_core.engine_core.executor.worker_pids() + [os.getpid()]
        time.sleep(0.5)
        before = [cpu_seconds(pid) for pid in pids]
        time.sleep(2.0)
        used = [cpu_seconds(pid) - start for pid, start in zip(pids, before)]
        # Ray's own threads in each worker wake now and then; a busy-polling loop would use ~2 s.
        assert all(seconds < 0.2 for seconds in used), used
    finally:
        llm.shutdown()


def test_placement_must_give_one_bundle_per_rank():
    """The cluster lays out a replica's placement group; the executor only follows it, and a
    layout with the wrong number of bundles is refused before anything starts."""
    from pagedserve.config import EngineConfig, WorkerPlacement
    from pagedserve.executor.ray_executor import RayExecutor

    config = EngineConfig(model="tiny", tensor_parallel_size=2)  # not resolved: refused first
    with pytest.raises(ValueError, match=r"2 ranks: need one per rank"):
        RayExecutor(config, None, WorkerPlacement(placement_group=None, bundle_indices=(1,)))


def test_a_worker_steps_only_on_the_thread_that_set_its_device_up(model_dirs):
    """The Ray executor calls every model method of a worker on its one model thread
    (ray_executor.MODEL_THREAD); a step loop started on another thread is refused before it
    connects, since its parallel ops would run on a second OpenMP team."""
    import threading

    from pagedserve.config import EngineConfig
    from pagedserve.engine.core.model_setup import resolve_core_model_config
    from pagedserve.workers.worker import Worker

    config = EngineConfig(model=str(model_dirs["llama"]), max_model_len=256, distributed_executor_backend="uni")
    worker = Worker(config, resolve_core_model_config(config))
    worker.init_device()
    assert worker.model_thread == threading.get_ident()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            worker.serve_steps("127.0.0.1", 9, b"secret")
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=loop)
    thread.start()
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "MODEL_THREAD" in str(errors[0])
