# Two entry points for a fresh machine (see README):
#   make run    installs everything, then runs the main job (tiny_demo) on the embedded default
#   make test   installs everything, then runs the test suite
PYTHON ?= python3
VENV   ?= .venv
PIP    := $(VENV)/bin/python -m pip
STAMP  := $(VENV)/.installed

.PHONY: install run test bench megatron clean

install: $(STAMP)

# torch is installed first and alone: `torch==2.13.0` resolves to the CPU wheel on CPU machines;
# letting the resolver pick torch later could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

run: install
	$(VENV)/bin/python -m asyncrl.train experiment=tiny_demo $(ARGS)

test: install
	$(VENV)/bin/python -m pytest $(ARGS)

# Optional tier: megatron-core declares Python >= 3.12 but its wheel works on 3.11.
megatron: install
	$(PIP) install -q -c constraints.txt numpy
	$(PIP) install -q --ignore-requires-python megatron-core==0.19.2

bench: install
	$(VENV)/bin/python bench/model_bench.py

clean:
	rm -rf $(VENV) runs outputs .pytest_cache
