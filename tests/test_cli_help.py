"""`pagedserve serve --help` lists every setting (a description with a % sign once crashed it)."""

from __future__ import annotations

import pytest

from pagedserve.cli import main


def test_serve_help_lists_the_settings(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--drain-timeout-s" in text and "--enforce-eager" in text and "about 12%" in text


def test_serve_on_a_public_host_without_a_key_refuses_before_anything_starts(capsys, monkeypatch):
    import pagedserve.cluster.launcher as launcher

    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    monkeypatch.setattr(launcher, "serve_forever", lambda config: pytest.fail("the server started"))
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    error = capsys.readouterr().err
    assert "host '0.0.0.0' accepts connections from other machines, but no API key is set" in error
    assert "--api-key-file FILE" in error and "--allow-unauthenticated" in error
    # Given explicitly, the flag lets it through to the launcher.
    started = []
    monkeypatch.setattr(launcher, "serve_forever", lambda config: started.append(config) or 0)
    assert main(["serve", "--host", "0.0.0.0", "--allow-unauthenticated"]) == 0
    assert started[0].host == "0.0.0.0" and started[0].allow_unauthenticated


def test_settings_the_server_hands_the_engine_are_one_flag_each(monkeypatch):
    """reasoning_parser and generation_config are both server and engine settings: one flag each
    (two once crashed `serve` at start), which sets both."""
    import pagedserve.cluster.launcher as launcher

    started = []
    monkeypatch.setattr(launcher, "serve_forever", lambda config: started.append(config) or 0)
    assert main(["serve", "--reasoning-parser", "qwen3", "--generation-config", "vllm"]) == 0
    engine = started[0].engine_config()
    assert (started[0].reasoning_parser, engine.reasoning_parser, engine.generation_config) == ("qwen3", "qwen3", "vllm")
