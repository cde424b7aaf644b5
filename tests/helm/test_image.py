"""The Dockerfile cannot be built here (no Docker, no registry): check what can be checked
without building it."""

from __future__ import annotations

import fnmatch
import re

import yaml

from tests.helm.conftest import CHART, REPO
from tests.helm.test_chart import pinned

DOCKERFILE = (REPO / "Dockerfile").read_text()
INSTALL = "pip install --no-cache-dir -c constraints.txt ."


def build_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE, re.M))


def test_base_image_is_the_pinned_ray():
    froms = re.findall(r"^FROM (\S+)", DOCKERFILE, re.M)
    bases = [image for image in froms if image.startswith("rayproject/ray:")]
    assert bases == ["rayproject/ray:${RAY_VERSION}-py311-cpu", "rayproject/ray:${RAY_VERSION}-py311-gpu"]
    assert build_args()["RAY_VERSION"] == pinned("ray")
    assert froms[-1] == "base-${VARIANT}" and build_args()["VARIANT"] == "cpu"


def test_chart_tracks_the_image():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["rayVersion"] == pinned("ray")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert chart["appVersion"] == version


def test_install_is_the_documented_one_with_the_constraints():
    assert f"RUN {INSTALL}\n" in DOCKERFILE
    assert INSTALL in (REPO / "docs" / "kubernetes.md").read_text()  # the image's step in the manual
    # The CPU variant takes torch's CPU build of the pinned version before that install.
    cpu_stage = DOCKERFILE.split("AS base-cpu", 1)[1].split("AS base-cuda", 1)[0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in cpu_stage
    assert "grep '^torch==' /tmp/constraints.txt" in cpu_stage
    assert pinned("torch")


def test_dockerignore_keeps_what_the_build_copies():
    ignored = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    copied = [name for line in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", DOCKERFILE, re.M) for name in line.split()]
    assert {"pyproject.toml", "constraints.txt", "README.md", "pagedserve"} <= set(copied)
    for name in copied:
        assert not any(fnmatch.fnmatch(name, pattern) for pattern in ignored), name


def test_image_has_no_sudo_and_runs_as_the_charts_non_root_user():
    """Nothing in the build runs sudo, the final stage removes the base image's sudo, and the
    image's last USER is the numeric non-root uid:gid the chart's podSecurityContext names."""
    runs = re.findall(r"^RUN ((?:.*\\\n)*.*)$", DOCKERFILE, re.M)
    # sudo as a command: at the start of a RUN or after a shell separator
    assert runs and not any(re.search(r"(^|[;&|]\s*)sudo\b", run) for run in runs), runs
    final = DOCKERFILE.split("FROM base-${VARIANT}", 1)[1]
    assert "apt-get purge -y sudo" in final
    assert re.findall(r"^USER (\S+)$", final, re.M)[-1] == "1000:100"
    context = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]
    assert (context["runAsUser"], context["runAsGroup"], context["runAsNonRoot"]) == (1000, 100, True)
