"""TP x PP ranks as Ray actors in one placement group, driven step by step over sockets.

Set-up (one-time) uses ordinary actor calls, so a failure while loading raises with the worker's
own error. Then every worker connects back to a socket of this process, authenticates with the
group's secret (see step_channel) and serves steps: each step the executor sends the pickled
`SchedulerOutput` to all ranks and reads one `StepReply` from each; the sampling rank's carries
the `ModelRunnerOutput`.

A dead worker shows up as a closed socket (a killed process), an error reply (an actor that
raised), or, while a step takes long, as a finished `serve_steps` call in Ray (a lost node); a
wedged one as a step still running after `step_timeout_s`. Any of them raises
`WorkerGroupError`; the engine then tears the group down (killing the actors) and builds a new one.
"""

from __future__ import annotations

import logging
import pickle
import selectors
import time
from typing import Any

from pagedserve.config import EngineConfig, ModelConfig, WorkerPlacement
from pagedserve.executor.executor import Executor, StepTooLargeError, WorkerGroupError
from pagedserve.ray_env import cluster_resources, ensure_ray_initialized
from pagedserve.step_types.model_runner_output import ModelRunnerOutput
from pagedserve.step_types.scheduler_output import SchedulerOutput
from pagedserve.workers import step_channel
from pagedserve.workers.worker import Worker

logger = logging.getLogger(__name__)

# How long a step may run before Ray is asked whether the workers are still alive.
LIVENESS_CHECK_INTERVAL_S = 1.0
PLACEMENT_GROUP_TIMEOUT_S = 60.0
STEP_CHANNEL_CONNECT_TIMEOUT_S = 60.0
LOOPBACK = "127.0.0.1"
# The worker's concurrency group of one thread that loads, profiles and steps its model: a CPU
# rank's parallel ops run on an OpenMP team per calling thread, and two teams in one process cost
# each op a wake-up (engine/async_llm.py's module doc). A 128-token SmolLM2 prefill on one rank of
# two threads, set up on one of the actor's threads and stepped on another: LLM.generate 124 ms,
# against 80 ms in process (2-core Zen 4, bf16; docs/benchmarks.md).
MODEL_THREAD = "model"


class RayExecutor(Executor):
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, placement: WorkerPlacement | None = None):
        """`placement`: rank i goes into bundle `placement.bundle_indices[i]` of its group (a
        Serve replica's); by default the executor creates and owns a group of TP x PP bundles."""
        super().__init__(engine_config, model_config)
        self.world_size = engine_config.world_size
        if placement is not None and len(placement.bundle_indices) != self.world_size:
            raise ValueError(
                f"{len(placement.bundle_indices)} placement group bundles {list(placement.bundle_indices)} "
                f"for tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks: need one per rank"
            )
        # The sampling rank: the last stage's first TP rank.
        self.driver_rank = (engine_config.pipeline_parallel_size - 1) * engine_config.tensor_parallel_size
        self.workers: list[Any] = []
        self.pids: list[int] = []
        self.loop_refs: list[Any] = []
        self.connections: list[step_channel.Channel] = []
        self.owns_placement_group = placement is None
        self.placement_group = placement.placement_group if placement is not None else None
        self.bundle_indices = placement.bundle_indices if placement is not None else tuple(range(self.world_size))
        self.node_ips: list[str] = []  # each rank's node
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    ranks_run_where = "in the Ray cluster"

    @classmethod
    def ranks_have_gpu(cls, engine_config: EngineConfig) -> bool:
        """GPUs if the Ray cluster has any (this process may well have none). Starts or joins
        Ray (with a CPU slot per rank) to ask."""
        return cluster_resources(engine_config.world_size).get("GPU", 0) > 0

    # ---- set-up --------------------------------------------------------------------------

    def _start(self) -> None:
        import ray

        ensure_ray_initialized(self.world_size)
        use_gpu = self.model_config.device == "cuda"
        if self.owns_placement_group:
            self.placement_group = self._create_placement_group(use_gpu)
        self.workers = [self._start_worker(rank, use_gpu) for rank in range(self.world_size)]
        self.node_ips = ray.get([w.get_node_ip.remote() for w in self.workers])
        init_method = self._distributed_init_method()
        ray.get([_on_model_thread(w.init_device).remote(init_method) for w in self.workers])
        ray.get([_on_model_thread(w.load_model).remote() for w in self.workers])
        self.pids = ray.get([w.get_pid.remote() for w in self.workers])

    def _create_placement_group(self, use_gpu: bool) -> Any:
        import ray
        from ray.util.placement_group import placement_group

        resource = "GPU" if use_gpu else "CPU"
        available = ray.cluster_resources().get(resource, 0)
        if available < self.world_size:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} needs {self.world_size} "
                f"{resource}s but the Ray cluster has {available:g}"
            )
        group = placement_group([{resource: 1}] * self.world_size, strategy="PACK", name="")
        try:
            ray.get(group.ready(), timeout=PLACEMENT_GROUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the Ray cluster could not place {self.world_size} {resource} bundles within "
                f"{PLACEMENT_GROUP_TIMEOUT_S:.0f} s (are the resources taken by someone else?)"
            ) from None
        return group

    def _start_worker(self, rank: int, use_gpu: bool) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=self.bundle_indices[rank])
        actor_class = ray.remote(concurrency_groups={MODEL_THREAD: 1})(Worker)  # serve_steps holds it for good
        return actor_class.options(
            num_cpus=0 if use_gpu else 1,
            num_gpus=1 if use_gpu else 0,
            scheduling_strategy=strategy,
            max_concurrency=1,  # the placement helpers' calls
        ).remote(self.engine_config, self.model_config, rank)

    def _distributed_init_method(self) -> str:
        """torch.distributed's rendezvous on rank 0's node: on the loopback address when every
        rank shares that node, so no other machine can reach it (README, Security)."""
        import ray

        port = ray.get(self.workers[0].find_free_port.remote())
        host = LOOPBACK if len(set(self.node_ips)) == 1 else self.node_ips[0]
        return f"tcp://{host}:{port}"

    def _open_step_channels(self) -> None:
        """Listen (on the loopback address when every rank runs on this node), hand each worker
        the group's secret in the call that starts its loop, and take one authenticated socket
        per rank. The listener closes once all ranks are in."""
        import ray

        engine_ip = ray.util.get_node_ip_address()
        is_local = all(ip == engine_ip for ip in self.node_ips)
        host = LOOPBACK if is_local else engine_ip
        secret = step_channel.new_secret()
        with step_channel.listen(host) as server:
            port = server.getsockname()[1]
            self.loop_refs = [_on_model_thread(w.serve_steps).remote(host, port, secret) for w in self.workers]
            try:
                # Only the group's own nodes may connect (the ranks connect from the address Ray
                # knows their node by; from the loopback address when all share this node).
                self.connections = step_channel.accept_ranks(
                    server, secret, self.world_size, STEP_CHANNEL_CONNECT_TIMEOUT_S, self._raise_if_workers_died,
                    allowed_ips={LOOPBACK} if is_local else set(self.node_ips),
                )
            except step_channel.ChannelError as error:
                self._raise_if_workers_died()
                raise WorkerGroupError(str(error)) from None
        for conn in self.connections:
            # A reply cut off mid-message must not block the engine for longer than a step may take.
            conn.settimeout(self.engine_config.step_timeout_s)

    # ---- Executor interface -----------------------------------------------------------------

    def determine_num_kv_blocks(self) -> int:
        import ray

        return min(ray.get([_on_model_thread(w.determine_num_kv_blocks).remote() for w in self.workers]))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        import ray

        ray.get([_on_model_thread(w.initialize_kv_cache).remote(num_blocks) for w in self.workers])
        # The set-up is done: from here on the steps go over the channels.
        self._open_step_channels()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        # Checked before anything is sent: an oversized step is the step's fault, not a dead
        # worker's (as a ChannelError from send_bytes, it once rebuilt the group until the
        # engine died: issue 19).
        if len(payload) > step_channel.MAX_MESSAGE_BYTES:
            raise StepTooLargeError(len(payload), step_channel.MAX_MESSAGE_BYTES)
        digest = step_channel.payload_digest(payload)  # hashed once for every rank's MAC
        try:
            for conn in self.connections:
                step_channel.send_bytes(conn, payload, digest)
        except OSError as error:
            raise WorkerGroupError(f"a worker is gone: {error}") from error
        replies = self._collect_replies()
        return replies[self.driver_rank]

    def _collect_replies(self) -> list[Any]:
        """Each rank's reply output. A rank that dies, raises, breaks the protocol, or is still
        busy after `step_timeout_s` (wedged in a collective, a stuck kernel) fails the group."""
        replies: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + self.engine_config.step_timeout_s
        with selectors.DefaultSelector() as selector:
            for rank, conn in enumerate(self.connections):
                selector.register(conn, selectors.EVENT_READ, rank)
            while pending:
                events = selector.select(timeout=min(LIVENESS_CHECK_INTERVAL_S, max(deadline - time.monotonic(), 0)))
                if not events:
                    self._raise_if_workers_died()
                    if time.monotonic() >= deadline:
                        raise WorkerGroupError(
                            f"worker rank(s) {sorted(pending)} did not answer within step_timeout_s="
                            f"{self.engine_config.step_timeout_s:g} s: treated as wedged"
                        )
                for key, _ in events:
                    rank = key.data
                    try:
                        reply = step_channel.recv_message(key.fileobj)
                    except (step_channel.ChannelClosed, step_channel.ChannelError) as error:
                        raise WorkerGroupError(f"worker rank {rank} died: {error}") from error
                    if reply.is_error:
                        raise WorkerGroupError(f"worker rank {rank} failed:\n{reply.error}")
                    replies[rank] = reply.output
                    pending.discard(rank)
                    selector.unregister(key.fileobj)
        return replies

    def _raise_if_workers_died(self) -> None:
        import ray

        done, _ = ray.wait(self.loop_refs, num_returns=1, timeout=0)
        if done:
            rank = self.loop_refs.index(done[0])
            try:
                ray.get(done[0])
                reason = "its step loop exited"
            except Exception as error:  # RayActorError: process or node gone
                reason = str(error).splitlines()[0]
            raise WorkerGroupError(f"worker rank {rank} died: {reason}")

    def worker_pids(self) -> list[int]:
        return list(self.pids)

    def shutdown(self) -> None:
        """Close the channels and kill the actors and the placement group; idempotent."""
        for conn in self.connections:
            conn.close()
        self.connections = []
        if not self.workers and self.placement_group is None:
            return
        import ray

        if not ray.is_initialized():  # Ray already shut down (interpreter exit): it took them along
            self.workers, self.loop_refs, self.placement_group = [], [], None
            return
        for worker in self.workers:
            try:
                ray.kill(worker)
            except Exception:  # already dead
                pass
        self.workers, self.loop_refs = [], []
        if self.owns_placement_group and self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:
                logger.warning("could not remove the placement group", exc_info=True)
        self.placement_group = None


def _on_model_thread(method: Any) -> Any:
    """A worker's actor method, called on its model thread (MODEL_THREAD)."""
    return method.options(concurrency_group=MODEL_THREAD)
