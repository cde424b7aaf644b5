"""The chart's fixtures: a pinned helm binary (fetched once, see tools/fetch_helm.py) and
`render`, which runs `helm template` and returns the manifests as dictionaries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pagedserve"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE = "ps"


@pytest.fixture(scope="session")
def helm() -> Path:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from fetch_helm import fetch_helm
    finally:
        sys.path.pop(0)
    return fetch_helm()


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def render(helm: Path, values_files: list[Path] = (), settings: dict[str, Any] | None = None) -> list[dict]:
    """`helm template` of the chart; raises AssertionError with helm's stderr if it fails."""
    result = run_helm(helm, *template_args(values_files, settings))
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def notes(helm: Path, values_files: list[Path] = (), settings: dict[str, Any] | None = None) -> str:
    """NOTES.txt as `helm install` prints it (a client-side dry run: no cluster is reached)."""
    args = template_args(values_files, settings)
    args[0] = "install"
    result = run_helm(helm, *args, "--dry-run=client")
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:\n", 1)[1]


def template_args(values_files: list[Path] = (), settings: dict[str, Any] | None = None) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", "llm"]
    for path in values_files:
        args += ["-f", str(path)]
    for name, value in (settings or {}).items():
        args += ["--set-json", f"{name}={json.dumps(value)}"]
    return args


def one(docs: list[dict], kind: str) -> dict:
    (doc,) = [doc for doc in docs if doc["kind"] == kind]
    return doc


def serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def pod_templates(rayservice: dict) -> list[tuple[str, dict, dict]]:
    """(group name, rayStartParams, pod spec) for the head and every worker group."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    groups = [("head", head["rayStartParams"], head["template"]["spec"])]
    for group in cluster.get("workerGroupSpecs", []):
        groups.append((group["groupName"], group["rayStartParams"], group["template"]["spec"]))
    return groups
