"""Every measured result records where it came from: the commit (and whether the tree was dirty),
the machine's CPU and the command (benchmarks/common.py's write_report adds them). The results
measured before write_report recorded them were re-measured from committed code or removed
(benchmarks/results/README.md, "Earlier investigations"), so no file here is exempt."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_every_result_records_its_commit_cpu_and_command():
    reports = sorted(RESULTS.rglob("*.json"))
    assert reports, f"no results under {RESULTS}"
    for path in reports:
        name = path.relative_to(RESULTS).as_posix()
        report = json.loads(path.read_text())
        provenance = report.get("provenance") or {}
        cpu = (provenance.get("machine") or report.get("machine") or {}).get("cpu")
        assert provenance.get("commit") and provenance.get("command") and cpu, f"{name}: no commit, command or CPU recorded"


def test_every_result_was_measured_on_a_clean_tree():
    """A result from a tree with uncommitted edits cannot be reproduced from the repository."""
    dirty = [path.relative_to(RESULTS).as_posix() for path in sorted(RESULTS.rglob("*.json"))
             if (json.loads(path.read_text()).get("provenance") or {}).get("is_dirty")]
    assert not dirty, f"measured on a tree with uncommitted edits: {dirty}"
