"""Every benchmark script answers --help (so none rots unnoticed between runs), and
benchmarks/common.py: what a result JSON records, the baseline commit, the baseline tree."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402


def scripts() -> list[Path]:
    """The runnable scripts: every file under benchmarks/ with a __main__ block."""
    return sorted(p for p in BENCHMARKS.rglob("*.py") if 'if __name__ == "__main__"' in p.read_text())


# One interpreter runs every script's --help (torch and pagedserve are imported once, not per
# script), and reports per script whether it printed its usage and exited 0.
HELP_RUNNER = textwrap.dedent(
    """
    import contextlib, io, json, runpy, sys
    results = {}
    for path in sys.argv[1:]:
        sys.argv = [path, "--help"]
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                runpy.run_path(path, run_name="__main__")
            results[path] = "returned without printing usage and exiting"
        except SystemExit as exit:
            results[path] = "ok" if exit.code in (0, None) and out.getvalue().startswith("usage:") else f"exit {exit.code}: {out.getvalue()[:200]}"
        except BaseException as error:
            results[path] = f"{type(error).__name__}: {error}"
    print("RESULTS " + json.dumps(results))
    """
)


def test_every_benchmark_script_answers_help():
    paths = [str(p) for p in scripts()]
    assert len(paths) >= 10, paths
    done = subprocess.run([sys.executable, "-c", HELP_RUNNER, *paths], capture_output=True, text=True, timeout=600, cwd=REPO)
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULTS ")), None)
    assert line is not None, done.stderr[-3000:]
    results = json.loads(line.removeprefix("RESULTS "))
    assert {path: r for path, r in results.items() if r != "ok"} == {}


def test_every_script_that_writes_json_records_provenance():
    """A script with --output writes its JSON through common.write_report (commit, machine, command)."""
    writers = [p for p in [*scripts(), REPO / "tools" / "soak.py", REPO / "tools" / "fuzz_http.py"] if '"--output"' in p.read_text()]
    assert len(writers) >= 10
    missing = [str(p.relative_to(REPO)) for p in writers if "write_report(" not in p.read_text()]
    assert missing == []


def test_cpu_info_reads_model_name_and_flags():
    text = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx512f avx512_bf16\n\nprocessor\t: 1\nmodel name\t: other\n"
    info = common.cpu_info(text)
    assert info["cpu"] == "AMD EPYC 9R14"
    assert info["cpu_flags"] == ["avx512_bf16", "avx512f", "fpu"]
    assert info["avx512_bf16"] is True and info["amx_bf16"] is False


def test_write_report_records_commit_machine_and_command(tmp_path, capsys):
    output = tmp_path / "sub" / "result.json"
    report = {"figure": 1.5}
    common.write_report(report, output, argv=["--flag", "2"])
    written = json.loads(output.read_text())
    assert written == json.loads(capsys.readouterr().out)
    assert written["figure"] == 1.5 and "provenance" in report  # added to the caller's dict too
    provenance = written["provenance"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert provenance["commit"] == head and isinstance(provenance["is_dirty"], bool)
    assert provenance["command"][-2:] == ["--flag", "2"] and provenance["command"][0] == sys.executable
    assert provenance["machine"]["num_cpus"] >= 1 and provenance["machine"]["cpu"] != ""


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A three-commit repository on `main` with a `pagedserve/` and a `tests/` folder."""
    def run(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    run("init", "-q", "-b", "main")
    run("config", "user.email", "t@t")
    run("config", "user.name", "t")
    for version in ("1", "2", "3"):
        for folder in ("pagedserve", "tests"):
            (tmp_path / folder).mkdir(exist_ok=True)
            (tmp_path / folder / "version.txt").write_text(version)
        run("add", ".")
        run("commit", "-q", "-m", version)
    monkeypatch.setattr(common, "REPO", tmp_path)
    return run


def test_files_of_a_commit_over_an_older_head_record_that_commit_only_if_they_are_its_tree(repo, monkeypatch):
    """The GPU machine's copy: the files of the newest commit over a clone whose HEAD is older
    (files that commit added are untracked there). PAGEDSERVE_SOURCE names the commit the files
    came from; it is believed only while the files on disk are exactly its tree."""
    (common.REPO / "added.txt").write_text("a file the newest commit adds")
    repo("add", "added.txt")
    repo("commit", "-q", "-m", "4")
    newest, newest_tree = common.git("rev-parse", "HEAD"), common.git("rev-parse", "HEAD^{tree}")
    assert common.commit_info() == {"commit": newest, "is_dirty": False, "tree": newest_tree}
    repo("reset", "-q", "--mixed", "HEAD~2")  # HEAD two commits back; the files stay the newest's
    older = common.git("rev-parse", "HEAD")
    assert common.commit_info() == {"commit": older, "is_dirty": True, "tree": newest_tree}
    monkeypatch.setenv(common.SOURCE_ENV, f"{newest} {newest_tree}")
    assert common.commit_info() == {"commit": newest, "is_dirty": False, "tree": newest_tree}
    (common.REPO / "scratch.txt").write_text("a file the newest commit does not have")
    info = common.commit_info()
    assert info["commit"] == older and info["is_dirty"] and info["tree"] != newest_tree
    assert common.git("write-tree") == common.git("rev-parse", "HEAD^{tree}")  # the repository's own index untouched


def test_default_baseline_is_head_parent_on_main_and_merge_base_on_a_branch(repo):
    assert common.default_baseline() == common.git("rev-parse", "HEAD~")
    fork = common.git("rev-parse", "HEAD")
    repo("checkout", "-q", "-b", "feature")
    (common.REPO / "pagedserve" / "version.txt").write_text("4")
    repo("commit", "-q", "-am", "4")
    repo("commit", "-q", "--allow-empty", "-m", "5")
    assert common.default_baseline() == fork


def test_baseline_tree_extracts_that_commit(repo):
    with common.baseline_tree("HEAD~2") as (commit, folder):
        assert commit == common.git("rev-parse", "HEAD~2")
        assert (folder / "pagedserve" / "version.txt").read_text() == "1"
        assert (folder / "tests" / "version.txt").read_text() == "1"
    assert not folder.exists()
    with pytest.raises(SystemExit, match="not a commit"):
        with common.baseline_tree("no-such-rev"):
            pass


def test_run_in_tree_imports_from_that_tree(tmp_path):
    (tmp_path / "marker_module.py").write_text("WHERE = 'baseline tree'\n")
    script = tmp_path / "script.py"
    script.write_text("import json, marker_module\nprint('noise')\nprint(json.dumps({'where': marker_module.WHERE}))\n")
    assert common.run_in_tree(tmp_path, str(script), []) == {"where": "baseline tree"}
    script.write_text("raise SystemExit('broken')\n")
    with pytest.raises(RuntimeError, match="broken"):
        common.run_in_tree(tmp_path, str(script), [])


def test_cpu_forwards_worker_imports_the_tree_it_measures(tmp_path):
    """Its worker (run_in_tree) must import pagedserve from the tree on PYTHONPATH: the script
    once put this checkout ahead of it, so its baseline was this tree. (It imports pagedserve at
    the top; engine_step_cpu.py and lora_kernel.py import it in the worker, from PYTHONPATH.)"""
    (tmp_path / "pagedserve").mkdir()
    (tmp_path / "pagedserve" / "__init__.py").write_text("raise ImportError('the tree under test was imported')\n")
    with pytest.raises(RuntimeError, match="the tree under test was imported"):
        common.run_in_tree(tmp_path, str(BENCHMARKS / "cpu_forward.py"), ["--help"])


def test_timing_helpers():
    calls = []
    assert common.least_ms(lambda: calls.append(1), repeats=3) >= 0
    assert len(calls) == 4  # a warm-up, then the repeats
    assert common.percentile([float(v) for v in range(1, 101)], 99) == 100.0
    assert common.percentile([3.0, 1.0, 2.0], 50) == 2.0
    prompts = common.random_token_prompts(5, 2, 4, seed=1, vocab=(100, 110))
    assert prompts == common.random_token_prompts(5, 2, 4, seed=1, vocab=(100, 110))
    assert all(2 <= len(p) <= 4 and all(100 <= t < 110 for t in p) for p in prompts)


def test_background_load_takes_its_share_of_a_core_and_stops():
    """The burner takes about the fraction asked of one core while the block runs (its CPU time
    over the block's wall time, loosely: a busy CI machine may give it less), and is gone after."""
    import os
    import time

    before = os.times()
    with common.background_load(0.5):
        time.sleep(1.0)
    after = os.times()
    burned = after.children_user + after.children_system - before.children_user - before.children_system
    assert 0.2 < burned < 0.8
    with pytest.raises(ValueError, match="fraction of one core"):
        with common.background_load(1.0):
            pass
    with common.background_load(0):  # nothing to start
        pass


def test_positive_ints_parses_a_list_and_refuses_what_is_not_one():
    import argparse

    assert common.positive_ints("1,2,8") == (1, 2, 8)
    for bad in ("", "1,,2", "0,4", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.positive_ints(bad)


def test_cpu_forward_refuses_decode_rows_below_one():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "cpu_forward.py"), "--model", "m", "--decode-rows", "0,8"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "--decode-rows" in result.stderr and "at least 1" in result.stderr
