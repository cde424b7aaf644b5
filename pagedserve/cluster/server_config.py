"""`pagedserve serve`'s settings: the server, its LLMServer deployment and its autoscaling, as
pydantic fields (the YAML file's keys and the command's flags map 1:1 onto them). The engine's own
knobs are `EngineConfig` (pagedserve/config.py), under `engine:`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagedserve.config import DEMO_MODEL, MODEL_HELP, EngineConfig, describe_validation_error
from pagedserve.lora_request import LoRARequest

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024**2

# A server's engine on the CPU runs at most this many requests at once unless `engine.max_num_seqs`
# says otherwise (offline engines keep EngineConfig's 256). At saturation a CPU decode step costs
# about the same per row at 128 rows as at 200, so the cap halves the time between tokens for the
# same throughput: 200 prompts at once on 2 Zen 4 cores, SmolLM2 bf16, ITL p50 344-376 ms against
# 570-614 ms, 222-230 against 219-231 output tok/s, TTFT p50 12.4-12.9 against 12.0 s (two runs
# each; docs/benchmarks.md).
SERVER_CPU_MAX_NUM_SEQS = 128
# And its steps compute at least this many tokens, more as more requests run, to hold the next
# prompt whole or as the queue deepens (EngineConfig's min_num_batched_tokens; offline engines
# keep every step at max_num_batched_tokens). 16 prompts of 128 tokens at once in one 2048-token
# step all wait for its end; in short steps they get their first tokens in turn. pagedserve alone,
# SmolLM2 bf16 on 2 Zen 4 cores, 64 prompts at 16 in flight (two runs each, a fixed 512 against
# 2048): TTFT p50 609 / 641 against 1284 / 1264 ms, 289 / 293 against 302 / 310 tok/s; at 64 in
# flight 3081 / 3014 against 3450 / 3380 ms; a 200-prompt burst was either side of 2048 (TTFT p50
# 10.3 / 11.0 against 10.5 / 9.6 s), which the growth with the running requests is for. A least of
# 512 still ran four prompts that arrive together in one step (TTFT p50 at 4 in flight 361 ms
# against vLLM's 355); 128 gives them out one by one. The queue's share (ab03b26) against none, two
# rounds in turns: TTFT p50 at 64 in flight 3164 / 3387 against 3409 / 3765 ms, the 200-prompt
# burst 9.47 / 9.90 against 10.51 / 10.47 s (388 / 392 against 378 / 375 tok/s), at 16 in flight
# 300 / 310 against 235 / 283 ms (docs/benchmarks.md).
SERVER_CPU_MIN_NUM_BATCHED_TOKENS = 128


class AutoscalingConfig(BaseModel):
    """Autoscaling the LLMServer on engine load (cluster/autoscaling.py): replicas are added while
    requests wait for a batch slot or the KV caches fill up, and removed once the load fits in
    fewer. The targets are per replica; Serve averages the replicas' reports over
    `look_back_period_s` and acts once a decision has held for the up/downscale delay."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, description="Fewest replicas (0: scale to zero when idle).")
    max_replicas: int = Field(4, ge=1, description="Most replicas; each needs its own CPUs/GPUs.")
    target_waiting_per_replica: float = Field(
        2.0, gt=0, description="Requests waiting in an engine's scheduler (or at Serve's handles) per replica before adding one."
    )
    target_kv_usage: float = Field(0.8, gt=0, le=1, description="Fraction of each replica's KV cache in use to aim for.")
    target_batch_usage: float = Field(
        1.0, gt=0, le=1, description="Fraction of each replica's batch slots (max_num_seqs) running to aim for; 1: full batches hold, waiting adds."
    )
    upscale_delay_s: float = Field(15.0, ge=0, description="How long the load must ask for more replicas before one is added.")
    downscale_delay_s: float = Field(300.0, ge=0, description="How long the load must fit in fewer replicas before one is removed.")
    look_back_period_s: float = Field(10.0, gt=0, description="Window the replicas' load is averaged over.")
    metrics_interval_s: float = Field(2.0, gt=0, description="How often each replica reports its load to Serve.")

    @model_validator(mode="after")
    def _bounds_and_window_are_ordered(self) -> AutoscalingConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscaling max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"autoscaling look_back_period_s ({self.look_back_period_s:g}) must be > metrics_interval_s "
                f"({self.metrics_interval_s:g}): the window must hold more than one report"
            )
        return self

    def serve_autoscaling_config(self) -> dict[str, Any]:
        """Serve's `autoscaling_config` for these settings, with pagedserve's policy."""
        policy_kwargs = {name: getattr(self, name) for name in ("target_waiting_per_replica", "target_kv_usage", "target_batch_usage")}
        serve_fields = ("min_replicas", "max_replicas", "upscale_delay_s", "downscale_delay_s", "look_back_period_s", "metrics_interval_s")
        return {
            **{name: getattr(self, name) for name in serve_fields},
            "policy": {"policy_function": AUTOSCALING_POLICY_IMPORT_PATH, "policy_kwargs": policy_kwargs},
        }


# cluster/autoscaling.py's policy, by import path: Serve's controller imports it (this module need not).
AUTOSCALING_POLICY_IMPORT_PATH = "pagedserve.cluster.autoscaling:EngineLoadPolicy"


class DeploymentConfig(BaseModel):
    """Ray Serve options of the LLMServer deployment. The replica count (`num_replicas`,
    `autoscaling`, `autoscaling_config`) is never part of a replica's arguments: changed through
    Serve's `deployments:` override (cluster/app.py: serve_application_config), it starts or
    stops only the replicas added or removed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_replicas: int = Field(1, ge=1, description="Fixed replica count (without autoscaling).")
    autoscaling: AutoscalingConfig | None = Field(
        None, description="Autoscale on engine load (waiting requests, KV-cache and batch usage); replaces num_replicas."
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Serve's own autoscaling config, passed through as given (its default policy scales on requests "
        "in flight, which says little about an LLM replica's load); replaces num_replicas. Prefer `autoscaling`.",
    )
    max_ongoing_requests: int = Field(256, ge=1, description="Requests one replica handles at once.")
    max_queued_requests: int = Field(-1, ge=-1, description="Requests waiting for a replica before 503s; -1: no limit.")
    num_cpus: float = Field(
        1.0, gt=0, description="CPUs Ray reserves for each LLMServer replica; a CPU engine in the replica gets as many torch threads."
    )
    request_router: Literal["prefix_aware", "power_of_two"] | None = Field(
        None,
        description="How requests pick an LLMServer replica: 'prefix_aware' (the replica whose KV cache most likely holds the "
        "prompt's prefix, unless it is out of balance) or 'power_of_two' (Serve's default). Default: prefix_aware, or "
        "power_of_two when the engine's prefix cache is off.",
    )
    imbalanced_threshold: float = Field(
        8.0,
        gt=0,
        description="prefix_aware: a replica whose load (engine requests running and waiting, or the router's own requests "
        "running there if more) exceeds the least-loaded replica's by more than this is passed over for the least-loaded one.",
    )
    match_rate_threshold: float = Field(
        0.1,
        ge=0,
        le=1,
        description="prefix_aware: the least fraction of a prompt's full KV blocks a replica must hold for the prompt to "
        "follow its prefix; below it the request goes to the least-loaded replica.",
    )
    routing_stats_period_s: float = Field(
        1.0, gt=0, description="prefix_aware: how often each replica reports its engine load and KV-cache evictions to the routers."
    )

    def resolved_request_router(self, enable_prefix_caching: bool) -> Literal["prefix_aware", "power_of_two"]:
        """`request_router`, or its default: prefix_aware wherever there is a prefix cache to aim
        at. The default does not depend on the replica count, which Serve's `deployments:`
        override may change without the app's args (and this config) ever seeing it."""
        if self.request_router is not None:
            return self.request_router
        return "prefix_aware" if enable_prefix_caching else "power_of_two"

    @model_validator(mode="after")
    def _one_way_to_autoscale(self) -> DeploymentConfig:
        if self.autoscaling is not None and self.autoscaling_config is not None:
            raise ValueError("set either deployment.autoscaling (on engine load) or deployment.autoscaling_config (Serve's own), not both")
        return self

    @property
    def is_one_fixed_replica(self) -> bool:
        """One replica, and no autoscaler to change that (what an engine in the ingress needs)."""
        return self.num_replicas == 1 and self.autoscaling is None and self.autoscaling_config is None

    @property
    def max_num_replicas(self) -> int:
        """The most replicas this deployment may run (what a local Ray is sized for)."""
        if self.autoscaling is not None:
            return self.autoscaling.max_replicas
        if self.autoscaling_config is not None:
            return int(self.autoscaling_config.get("max_replicas", 1))
        return self.num_replicas

    def serve_scaling_options(self) -> dict[str, Any]:
        """Serve's `num_replicas` or `autoscaling_config` for the LLMServer deployment."""
        if self.autoscaling is not None:
            return {"autoscaling_config": self.autoscaling.serve_autoscaling_config()}
        if self.autoscaling_config is not None:
            return {"autoscaling_config": self.autoscaling_config}
        return {"num_replicas": self.num_replicas}


def parse_lora_module(text: str, lora_int_id: int) -> LoRARequest:
    """One --lora-modules entry: 'name=path', or vLLM's JSON {"name", "path", "base_model_name"}."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
            return LoRARequest(entry["name"], lora_int_id, entry["path"], entry.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"lora_modules entry {text[:80]!r}: a JSON entry needs 'name' and 'path' ({error})") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"lora_modules entry {text[:80]!r} must be 'name=path' or a JSON object")
    return LoRARequest(name, lora_int_id, path)


# Serve's switch for direct ingress (the ingress replica answers HTTP itself), read from each Ray
# process's environment when it starts (cluster/launcher.py sets it for a cluster it starts).
SERVE_DIRECT_INGRESS_VARIABLE = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


class ServerConfig(BaseModel):
    """`pagedserve serve`: the YAML file's keys and the command's flags. Engine arguments go
    under `engine:` (flags keep their names: --max-model-len sets engine.max_model_len)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(DEMO_MODEL, description=MODEL_HELP)
    served_model_name: str | None = Field(None, description="The name clients ask for; default: the model argument as given.")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_key: str | None = Field(
        None, min_length=1, description="Required as 'Authorization: Bearer KEY' (or PAGEDSERVE_API_KEY, or api_key_file)."
    )
    api_key_file: str | None = Field(
        None, min_length=1, description="A file holding the API key (kept out of command lines and configs); missing or empty: an error."
    )
    allow_unauthenticated: bool = Field(
        False, description="Serve on a host other than loopback with no API key: anyone who reaches the port may send requests."
    )
    max_request_body_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BODY_BYTES, ge=1, description="Larger request bodies are refused with 413."
    )
    metrics_require_api_key: bool = Field(
        False, description="GET /metrics needs the API key too (default: open, as Prometheus scrapers usually carry none)."
    )
    graceful_shutdown_s: float = Field(30.0, ge=0, description="How long in-flight requests may finish after SIGTERM.")
    drain_timeout_s: float = Field(
        20.0,
        ge=0,
        le=3600,
        description="An LLMServer replica that receives SIGTERM hands its streams over to other replicas at once and "
        "refuses new ones; streams that cannot move (cumulative outputs with text sent) may run this long before they are stopped "
        "too, and the replica exits. Keep it under the sender's own grace period (Kubernetes: 30 s by default).",
    )
    stream_interval_ms: float = Field(
        0.0,
        ge=0,
        description="A stream's tokens that pile up while one chunk is sent go out merged in the next; an idle "
        "stream's go out at once. >0: also wait this long after each chunk (fewer, larger chunks).",
    )
    engine_transport: Literal["grpc", "actor"] = Field(
        "grpc",
        description="How the ingress reaches the LLMServer replicas: 'grpc' (Serve's gRPC transport; calls whose arguments "
        "pickle past 1 MiB go as 'actor' calls) or 'actor' (Ray's actor calls and object store).",
    )
    http_ingress: Literal["auto", "direct", "proxy"] = Field(
        "auto",
        description="Who answers HTTP on the port: 'direct' (the ingress replica itself, Serve's direct ingress: one actor hop "
        "less per request and per streamed token; needs a Ray cluster `pagedserve serve` starts), 'proxy' (Serve's HTTP proxy, "
        "which hands each request to an ingress replica), or 'auto' (direct where this command starts Ray, else proxy).",
    )
    engine_host: Literal["auto", "ingress", "replicas"] = Field(
        "auto",
        description="Where the engine's AsyncLLM runs: 'replicas' (LLMServer replicas behind a Serve handle: scalable, "
        "autoscaled, streams handed over on a drain), 'ingress' (in the ingress replica's process, as vLLM's API server "
        "holds its engine: one process hop less per request and per streamed token; one engine, no scaling), or 'auto' "
        "(ingress where `pagedserve serve` starts Ray itself and one fixed replica is asked for, else replicas).",
    )
    # The OpenAI front end (vLLM's flags; docs/structured-outputs.md).
    enable_auto_tool_choice: bool = Field(
        False, description='tool_choice "auto": free generation, then --tool-call-parser finds the calls in the text.'
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "json"] | None = Field(
        None, description="The model's tool-call format, for tool_choice auto (hermes: Qwen2.5/Qwen3; json: a plain JSON call)."
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None, description="Split the model's <think>...</think> into message.reasoning_content."
    )
    generation_config: str = Field(
        "auto",
        description="Sampling defaults for fields a request omits: 'auto' (the model folder's generation_config.json), "
        "'vllm' (none: temperature 1.0) or a folder holding a generation_config.json.",
    )
    lora_modules: list[str] = Field(
        default_factory=list,
        description="LoRA adapters served by name, as vllm serve's --lora-modules: 'name=path' or a JSON object "
        '{"name": ..., "path": ..., "base_model_name": ...}; a request whose model is the name runs that adapter. '
        "Needs engine enable_lora (--enable-lora).",
    )
    lora_dirs: list[str] = Field(
        default_factory=list,
        description="Folders POST /v1/load_lora_adapter may load adapters from (the path, symlinks followed, must lie "
        "inside one); empty: adapters are only the lora_modules. Needs engine enable_lora.",
    )
    engine: dict[str, Any] = Field(default_factory=dict, description="EngineConfig fields other than model.")
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)

    @model_validator(mode="after")
    def _engine_arguments_are_valid(self) -> ServerConfig:
        if "model" in self.engine:
            raise ValueError("set the model at the top level ('model:'), not under 'engine:'")
        self.engine_config()  # raises, naming the bad key
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (hermes, llama3_json, mistral or json)")
        self.lora_requests()  # raises, naming the bad entry
        return self

    def lora_requests(self) -> list[LoRARequest]:
        """The served adapters, ids 1, 2, ... in the order given (the same on every replica)."""
        if (self.lora_modules or self.lora_dirs) and not self.engine_config().enable_lora:
            raise ValueError("lora_modules and lora_dirs need the engine's enable_lora (--enable-lora; YAML: engine: {enable_lora: true})")
        adapters = [parse_lora_module(text, i + 1) for i, text in enumerate(self.lora_modules)]
        names = [adapter.lora_name for adapter in adapters]
        if len(set(names)) != len(names) or self.model_name in names:
            raise ValueError(f"lora_modules names must be unique and differ from the served model's name {self.model_name!r}: {names}")
        return adapters

    @model_validator(mode="after")
    def _engine_in_ingress_is_one_engine(self) -> ServerConfig:
        if self.engine_host == "ingress" and not self.deployment.is_one_fixed_replica:
            raise ValueError(
                "engine_host 'ingress' runs one engine, in the ingress's process: it cannot have deployment.num_replicas > 1 "
                "or autoscaling; use engine_host 'replicas' (or 'auto') to scale"
            )
        return self

    @model_validator(mode="after")
    def _exposed_host_needs_a_key(self) -> ServerConfig:
        # Checked here so a YAML file and the flags refuse alike, before Ray or a model starts.
        if is_loopback(self.host) or self.allow_unauthenticated:
            return self
        if self.api_key or self.api_key_file or os.environ.get("PAGEDSERVE_API_KEY"):
            return self
        raise ValueError(
            f"host '{self.host}' accepts connections from other machines, but no API key is set: set one with "
            "--api-key-file FILE (api_key_file: a file holding the key; e.g. openssl rand -hex 24 > FILE), "
            "--api-key KEY or the PAGEDSERVE_API_KEY environment variable, or serve on 127.0.0.1; "
            "--allow-unauthenticated (allow_unauthenticated: true) serves without one"
        )

    def engine_config(self) -> EngineConfig:
        # The server's reasoning parser also tells the engine where a grammar starts; its
        # generation config is the engine's too. A server's clients send schemas: the engine
        # builds its grammar backend at start (unless the engine settings say otherwise).
        shared = {"generation_config": self.generation_config, "structured_outputs_prewarm": True}
        if self.reasoning_parser:
            shared["reasoning_parser"] = self.reasoning_parser
        return EngineConfig.from_kwargs(model=self.model, **{**shared, **self.engine})

    def replica_engine_config(self, has_gpu: bool) -> EngineConfig:
        """The engine config a replica runs (`has_gpu`: the replica's process sees a GPU): the
        server's on a GPU; on the CPU with SERVER_CPU_MAX_NUM_SEQS and SERVER_CPU_MIN_NUM_BATCHED_TOKENS
        where the settings name neither (the latter with chunked prefill only)."""
        engine = self.engine_config()
        on_cpu = engine.device == "cpu" or (engine.device == "auto" and not has_gpu)
        if not on_cpu:
            return engine
        update = {} if "max_num_seqs" in self.engine else {"max_num_seqs": SERVER_CPU_MAX_NUM_SEQS}
        if "min_num_batched_tokens" not in self.engine and engine.enable_chunked_prefill:
            cap = engine.max_num_batched_tokens or SERVER_CPU_MIN_NUM_BATCHED_TOKENS
            update["min_num_batched_tokens"] = min(SERVER_CPU_MIN_NUM_BATCHED_TOKENS, cap)
        return engine.model_copy(update=update) if update else engine

    def resolve_api_key(self) -> str | None:
        """The key clients must send: `api_key`, else the contents of `api_key_file`, else
        PAGEDSERVE_API_KEY in this process's environment; None if none is set. A key file that
        is missing or empty is an error: a server asked for a key never runs without one."""
        if self.api_key:
            return self.api_key
        if self.api_key_file:
            try:
                key = Path(self.api_key_file).expanduser().read_text().strip()
            except OSError as error:
                raise ValueError(f"cannot read api_key_file '{self.api_key_file}': {error.strerror or error}") from None
            if not key:
                raise ValueError(f"api_key_file '{self.api_key_file}' is empty: it must hold the API key")
            return key
        return os.environ.get("PAGEDSERVE_API_KEY") or None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServerConfig:
        """A YAML file's settings with `overrides` (flags) on top; engine and deployment fields may
        be given flat in the overrides. Raises ValueError naming the bad key."""
        import yaml

        data: dict[str, Any] = {}
        if path is not None:
            try:
                data = yaml.safe_load(Path(path).read_text()) or {}
            except (OSError, yaml.YAMLError) as error:
                raise ValueError(f"cannot read config file {path}: {error}") from None
            if not isinstance(data, dict):
                raise ValueError(f"config file {path} must hold a mapping of settings")
        data = {**data, "engine": dict(data.get("engine") or {}), "deployment": dict(data.get("deployment") or {})}
        for name, value in (overrides or {}).items():
            if name in EngineConfig.model_fields and name not in cls.model_fields:
                data["engine"][name] = value
            elif name in DeploymentConfig.model_fields:
                data["deployment"][name] = value
            else:
                data[name] = value
        try:
            return cls(**data)
        except ValidationError as error:
            raise ValueError(describe_validation_error(error, "setting")) from None


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to any interface
