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
