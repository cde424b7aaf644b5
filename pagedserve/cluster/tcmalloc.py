"""tcmalloc for the Ray processes `pagedserve serve` starts on a machine of its own.

glibc's allocator serves a CPU engine's many short-lived tensors (each step's activations, of a
new size whenever the batch changes) less well than tcmalloc, which vLLM's CPU docs have their
users preload for the same reason. Preloaded into every Ray process, offline bf16 ran 5-7%
faster on a 2-core Zen 5 (SmolLM2, 256 prompts: 22.7 and 23.6 s against 24.4 and 24.7 s;
benchmarks/results/tcmalloc_zen5/). A library can only be preloaded when a process starts, so
the command sets LD_PRELOAD before it starts Ray, whose processes inherit it: the raylet, the
replicas, their engine core processes. tcmalloc is a system package (Debian:
libtcmalloc-minimal4), not a Python one: where it is missing nothing changes.
PAGEDSERVE_TCMALLOC=0 turns this off; a tcmalloc already in LD_PRELOAD is left alone.
"""

from __future__ import annotations

import os
from pathlib import Path

SWITCH = "PAGEDSERVE_TCMALLOC"
NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib/aarch64-linux-gnu",
    "/usr/lib64", "/lib64", "/usr/local/lib", "/usr/lib",
)


def find(library_dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    """The first tcmalloc in `library_dirs`, or None."""
    for folder in library_dirs:
        for name in NAMES:
            path = Path(folder) / name
            if path.is_file():
                return str(path)
    return None


def preload_for_children(environ: dict | None = None, library_dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    """Adds tcmalloc to `environ`'s LD_PRELOAD (default: this process's, which the processes it
    starts inherit); returns what is preloaded now, or None (switched off, or not installed)."""
    environ = os.environ if environ is None else environ
    if environ.get(SWITCH, "1") == "0":
        return None
    preloaded = [entry for entry in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if entry]
    already = next((entry for entry in preloaded if "tcmalloc" in Path(entry).name), None)
    if already is not None:
        return already
    path = find(library_dirs)
    if path is not None:
        environ["LD_PRELOAD"] = ":".join([path, *preloaded])
    return path
