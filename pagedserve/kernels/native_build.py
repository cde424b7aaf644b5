"""Builds and loads the C++ CPU kernels in `csrc/` on the machine that runs them.

The kernels are compiled once per machine (`g++ -O3 -march=native -fopenmp`, against torch's
headers and libraries) into a cache folder, keyed by a hash of the source, torch's version, the
compiler's flags and the CPU's feature flags, so a changed kernel or another CPU builds anew and a
second process, or a second start, only loads the library. Builds are serialized by a file lock
(the workers of one engine start together) and land by an atomic rename.

When no compiler is there, or the build fails, `load()` returns False and logs why once: the
caller keeps its pure-torch path. `PAGEDSERVE_NATIVE_KERNELS=0` turns the native path off.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = ("cpu_paged_attention.cpp", "cpu_layers.cpp", "cpu_argmax.cpp", "cpu_small_linear.cpp", "cpu_fp32_gemm.cpp", "cpu_lora.cpp", "cpu_grammar_mask.cpp", "cpu_thread_binding.cpp")
CSRC = Path(__file__).parent / "csrc"
ENV_SWITCH = "PAGEDSERVE_NATIVE_KERNELS"
ENV_CACHE = "PAGEDSERVE_KERNEL_CACHE"
BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_state: dict[str, bool] = {}


def load() -> bool:
    """True once the kernels' ops are registered (`torch.ops.pagedserve_cpu.*`)."""
    if "loaded" in _state:  # the layers ask on every call: no lock once the answer is known
        return _state["loaded"]
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _try_load()
        return _state["loaded"]


def _try_load() -> bool:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("native CPU kernels off (%s=0): using the pure-torch attention", ENV_SWITCH)
        return False
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C++ compiler (g++) found: the CPU attention stays on its slower pure-torch path")
        return False
    try:
        library = _build(compiler)
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("building the native CPU kernels failed, using the pure-torch attention: %s", error)
        return False
    logger.info("native CPU kernels loaded from %s; paths compiled for this CPU: %s", library.name, ", ".join(sorted(_compiled_paths())) or "portable only")
    return True


def compiled_paths() -> frozenset[str]:
    """The instruction-set paths the build compiled (`-march=native` decides): "avx512" (the
    attention's register path for head_dim 64 and 128), or "avx2" where the CPU has no AVX-512
    (the same path eight lanes wide, and SiLU's) with "avx2_prefill_blocks" (prefill chunks in
    blocks of rows), "avx512_bf16" (its bf16 dot products) and
    "small_linear_bf16" (the light-step linear). Empty when the kernels did not build."""
    return _compiled_paths() if load() else frozenset()


def _compiled_paths() -> frozenset[str]:
    isa = torch.ops.pagedserve_cpu.attention_isa()
    paths = {name for bit, name in ((1, "avx512"), (2, "avx512_bf16"), (4, "avx2"), (8, "avx2_prefill_blocks")) if isa & bit}
    if torch.ops.pagedserve_cpu.small_linear_max_rows() > 0:
        paths.add("small_linear_bf16")
    return frozenset(paths)


def find_compiler() -> str | None:
    """$CXX, else g++, else c++ on the PATH; None without one."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def compile_flags() -> list[str]:
    """g++'s flags for the kernels (tools/native_throw_probe.py builds with them too)."""
    torch_dir = Path(torch.__file__).parent
    includes = [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in includes),
        f"-I{sysconfig.get_paths()['include']}",
        # torch's own libgomp (same soname as the system's): one OpenMP runtime in the process.
        f"-L{torch_dir / 'lib'}", f"-Wl,-rpath,{torch_dir / 'lib'}",
        "-lc10", "-ltorch_cpu", "-lgomp",
    ]  # fmt: skip


def _cpu_flags() -> str:
    return _cpuinfo_field("flags")


def cpu_vendor_family() -> tuple[str, int | None]:
    """The first CPU's vendor ("AuthenticAMD", "GenuineIntel") and family number, from
    /proc/cpuinfo; ("", None) where it does not say (another OS or architecture)."""
    family = _cpuinfo_field("cpu family").partition(":")[2].strip()
    return _cpuinfo_field("vendor_id").partition(":")[2].strip(), int(family) if family.isdigit() else None


def _cpuinfo_field(name: str) -> str:
    """The first line of /proc/cpuinfo for `name`, or ""."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> Path:
    flags = compile_flags()
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):  # the sources and the headers they include
        digest.update(path.name.encode() + path.read_bytes())
    for part in (torch.__version__, compiler, " ".join(flags), _cpu_flags()):
        digest.update(part.encode())
    cache = Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "pagedserve" / "kernels")
    cache.mkdir(parents=True, exist_ok=True)
    library = cache / f"pagedserve_cpu_{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    with open(cache / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same library
        if library.exists():
            return library
        logger.warning("building pagedserve's native CPU kernels into %s (once per machine, about a minute on two cores)", cache)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        command = [compiler, *(str(CSRC / name) for name in SOURCES), "-o", str(partial), *flags]
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"{compiler} exited {done.returncode}: {done.stderr[-2000:]}")
        os.replace(partial, library)
    return library
