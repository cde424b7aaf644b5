"""Why a native op's failed TORCH_CHECK crashed the process instead of raising, as it did on the
lent GPU machine's Intel host (torch 2.11.0+cu130, g++ 13.3; benchmarks/results/README.md), where
it raises here (torch 2.13.0+cpu, g++ 12.2).

Builds a one-op library whose check always fails, with native_build.py's flags and then with one
thing changed at a time, and calls the op in a process of its own for each. A variant reads
"raised" where the RuntimeError reached Python, else the signal or exit code that ended the
process. The variant that raises where the others crash names the cause; if all crash, the
exception's path between the toolchain and torch's libraries is the suspect (`plain_exception`
throws a std::runtime_error, which builds no c10 backtrace).

    python tools/native_throw_probe.py --output probe.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

import common  # noqa: E402

SOURCE = r"""
#include <stdexcept>
#include <ATen/ATen.h>
#include <torch/library.h>
namespace {
void fail(const at::Tensor& t) {
#ifdef PLAIN_EXCEPTION
  if (t.size(0) >= 0) throw std::runtime_error("a plain exception");
#else
  TORCH_CHECK(t.size(0) < 0, "size ", t.size(0), " is not below 0");
#endif
}
}  // namespace
TORCH_LIBRARY(probe_throw, m) { m.def("fail(Tensor t) -> ()"); }
TORCH_LIBRARY_IMPL(probe_throw, CPU, m) { m.impl("fail", &fail); }
"""

CALL = """
import sys, torch
torch.ops.load_library(sys.argv[1])
try:
    torch.ops.probe_throw.fail(torch.zeros(1))
except RuntimeError as error:
    print("raised:", str(error).splitlines()[0])
"""


def variants(flags: list[str]) -> dict[str, list[str]]:
    """name -> g++ flags: native_build's, then each with one thing changed."""
    def without(*dropped: str) -> list[str]:
        return [f for f in flags if f not in dropped]

    return {
        "native_build": flags,
        "no_march_native": without("-march=native"),
        "unoptimized": ["-O0" if f == "-O3" else f for f in flags],
        "no_openmp": without("-fopenmp", "-lgomp"),
        "cxx17": ["-std=c++17" if f == "-std=c++20" else f for f in flags],
        "no_cf_protection": [*flags, "-fcf-protection=none"],
        "links_libtorch": [*flags, "-ltorch"],
        "plain_exception": [*flags, "-DPLAIN_EXCEPTION"],
    }


def probe(name: str, flags: list[str], folder: Path, compiler: str) -> dict:
    source, library = folder / f"{name}.cpp", folder / f"{name}.so"
    source.write_text(SOURCE)
    built = subprocess.run([compiler, str(source), "-o", str(library), *flags], capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        return {"variant": name, "outcome": "did not build", "detail": built.stderr[-1000:]}
    ran = subprocess.run([sys.executable, "-c", CALL, str(library)], capture_output=True, text=True, timeout=120)
    if ran.returncode == 0 and ran.stdout.startswith("raised"):
        outcome = "raised"
    elif ran.returncode < 0:
        outcome = f"killed by signal {-ran.returncode}"
    else:
        outcome = f"exited {ran.returncode}"
    return {"variant": name, "outcome": outcome, "detail": (ran.stdout + ran.stderr)[-1000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", help="comma-separated names (default: all)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    import torch  # after --help, which needs no torch

    from pagedserve.kernels import native_build

    compiler = native_build.find_compiler()
    if compiler is None:
        raise SystemExit("no C++ compiler (g++) found")
    chosen = variants(native_build.compile_flags())
    if args.variants:
        chosen = {name: chosen[name] for name in args.variants.split(",")}
    with tempfile.TemporaryDirectory() as scratch, concurrent.futures.ThreadPoolExecutor() as pool:
        futures = [pool.submit(probe, name, flags, Path(scratch), compiler) for name, flags in chosen.items()]
        results = [future.result() for future in futures]
    for result in results:
        print(f"{result['variant']:>18}: {result['outcome']}", file=sys.stderr)
    # Two OpenMP runtimes in one process would be another suspect: the one torch maps, beside
    # the compiler's (which -lgomp finds where torch's lib folder has no libgomp.so).
    mapped = sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "omp" in line.rsplit("/", 1)[-1]})
    report = {"torch": torch.__version__, "compiler": compiler, "torch_openmp_mapped": mapped, "results": results}
    common.write_report(report, args.output)


if __name__ == "__main__":
    main()
