"""An adapter the engine cannot serve exactly is refused where it enters, with an error naming
the field; nothing is queued. The registry keeps an id bound to one adapter for good."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine.lora_registry import LoRARegistry
from pagedserve.workers.lora.peft_adapter import check_adapter


def edited(adapter, tmp_path, **changes):
    """A copy of the adapter folder with its config changed."""
    folder = tmp_path / "edited"
    shutil.copytree(adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize("changes, message", [
    ({"r": 64}, "adapter rank r=64 exceeds max_lora_rank=16"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules \['lm_head'\] are not served"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias 'all' is not served"),
    ({"use_dora": True}, "use_dora is not served"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not served"),
])
def test_unserved_adapters_are_refused_naming_the_field(lora_adapters, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        check_adapter(str(edited(lora_adapters["llama"]["all8"], tmp_path, **changes)), max_lora_rank=16)


def test_missing_files_are_refused(lora_adapters, tmp_path):
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        check_adapter(str(tmp_path), 16)
    folder = edited(lora_adapters["llama"]["all8"], tmp_path)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no adapter_model.safetensors"):
        check_adapter(str(folder), 16)


def test_the_registry_binds_an_id_to_one_adapter(lora_adapters, model_dirs):
    registry = LoRARegistry(EngineConfig(model=str(model_dirs["llama"]), enable_lora=True))
    first = LoRARequest("a", 1, str(lora_adapters["llama"]["all8"]))
    assert registry.add(first) and not registry.add(first) and registry.list() == {1}
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'a'"):
        registry.check(LoRARequest("b", 1, str(lora_adapters["llama"]["qv4"])))
    assert registry.remove(1) and not registry.remove(1) and registry.list() == set()
    with pytest.raises(ValueError, match="never reused for another adapter"):
        registry.check(LoRARequest("b", 1, str(lora_adapters["llama"]["qv4"])))
    assert registry.check(first) is first  # the same adapter may come back


def test_bad_lora_requests_queue_nothing(model_dirs, lora_adapters):
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "x")
    with pytest.raises(ValueError, match="enable_lora runs the model eagerly"):
        EngineConfig(model="x", enable_lora=True, enforce_eager=False)
    adapter = LoRARequest("all8", 1, str(lora_adapters["llama"]["all8"]))
    plain = LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="needs an engine started with enable_lora=True"):
            plain.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=adapter)
        assert not plain.llm_engine.has_unfinished_requests()
    finally:
        plain.shutdown()
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=64, enable_lora=True, max_lora_rank=4)
    try:
        with pytest.raises(ValueError, match="r=8 exceeds max_lora_rank=4"):
            llm.generate(["Hello", "Hi"], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=[None, adapter])
        with pytest.raises(ValueError, match="got 2 prompts but 1 lora requests"):
            llm.generate(["Hello", "Hi"], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=[None])
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_the_server_flags_as_vllm_spells_them(monkeypatch):
    """`pagedserve serve --enable-lora --lora-modules name=path {json} --max-loras N
    --max-lora-rank R`; ids follow the order given."""
    import pagedserve.cluster.launcher as launcher
    from pagedserve.cli import main

    started = []
    monkeypatch.setattr(launcher, "serve_forever", lambda config: started.append(config) or 0)
    assert main(["serve", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                 "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}']) == 0
    config = started[0]
    assert config.engine == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    assert config.lora_requests() == [LoRARequest("sql", 1, "/a/sql"), LoRARequest("chat", 2, "/a/chat", "m")]


@pytest.mark.parametrize("modules, engine, message", [
    (["sql=/a"], {}, "lora_modules and lora_dirs need the engine's enable_lora"),
    (["sql"], {"enable_lora": True}, "must be 'name=path' or a JSON object"),
    (['{"name": "x"}'], {"enable_lora": True}, "a JSON entry needs 'name' and 'path'"),
    (["a=/x", "a=/y"], {"enable_lora": True}, "names must be unique"),
    (["base=/x"], {"enable_lora": True}, "differ from the served model's name 'base'"),
])
def test_bad_server_adapters_are_refused_before_anything_starts(modules, engine, message):
    from pagedserve.cluster.server_config import ServerConfig

    with pytest.raises(ValueError, match=message):
        ServerConfig(model="m", served_model_name="base", lora_modules=modules, engine=engine)


def test_runtime_adapter_paths_must_lie_inside_lora_dirs(tmp_path):
    from pagedserve.cluster.lora_adapters import allowed_adapter_path

    allowed, other = tmp_path / "adapters", tmp_path / "secrets"
    (allowed / "a").mkdir(parents=True)
    other.mkdir()
    (allowed / "out").symlink_to(other)
    assert allowed_adapter_path(str(allowed / "a"), [str(allowed)]) == str((allowed / "a").resolve())
    for path, message in [
        (str(other), "must lie inside"), (str(allowed / "out"), "must lie inside"),
        (f"{allowed}/a/../a", "must not contain '..'"), (str(tmp_path / "adapters-2"), "must lie inside"),
    ]:
        with pytest.raises(ValueError, match=message):
            allowed_adapter_path(path, [str(allowed)])
    with pytest.raises(ValueError, match="loading adapters at runtime is off"):
        allowed_adapter_path(str(allowed / "a"), [])
