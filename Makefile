# One command to install and run, one to install and test. Both create .venv on first use.
# torch is pinned (constraints.txt) to the CPU build so no CUDA wheels are downloaded.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP_INSTALL := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install run generate test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -c constraints.txt -e ".[test]"
	touch $@

# The OpenAI-compatible server on the demo model, at http://127.0.0.1:8000/v1 (Ctrl-C stops it).
run: install
	$(VENV)/bin/pagedserve serve

generate: install
	$(VENV)/bin/pagedserve generate

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

bench: install
	HF_HUB_OFFLINE=1 $(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
