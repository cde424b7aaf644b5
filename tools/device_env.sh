# Sourced by tools/gpu_check.sh and tools/host_cpu_check.sh, on the lent GPU machine: Python
# packages its image lacks, carried as wheels in .whl/, go under /tmp/site; this checkout goes on
# PYTHONPATH; `files_line` prints the commit the results will record (benchmarks/common.py).
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

files_line() {
    $PY -c 'import sys; sys.path.insert(0, "benchmarks"); import common; print("files:", common.commit_info())'
}
