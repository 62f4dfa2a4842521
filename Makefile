# Two commands: `make run` (the main job) and `make test`. Each sets itself up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test docs test-gpu test-jax011 compile-h100 gpu-bundle bench clean real-model run-real tunix-venv machine-pass

$(STAMP): requirements.txt requirements-base.txt requirements-test.txt pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "pipelinerl_jax needs Python 3.11 or newer; set PYTHON=python3.11"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# Each run gets its own directory (metrics, checkpoints, samples) unless ARGS names a --workdir.
RUN_WORKDIR = $(if $(findstring --workdir,$(ARGS)),,--workdir=runs/$$(date +%Y%m%d-%H%M%S))

run: $(STAMP)
	$(PY) launch.py $(RUN_WORKDIR) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=20 tests

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link, anchor
# or nav entry, as tests/test_docs.py does. `.venv/bin/python -m mkdocs serve` previews it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The GPU stack of requirements-gpu.txt (jax 0.11.2, its CUDA plugin, jax-triton 0.3.1, triton
# 3.6) in a Python 3.12 venv: jax 0.11 is served only for 3.12. Here the registry serves torch
# for 3.12 only as its CUDA build (gigabytes), so this venv has none and the suite leaves out the
# modules that compare against torch (PIPELINERL_WITHOUT_TORCH=1 in tests/conftest.py). Not part
# of `make test`: it downloads the CUDA plugin wheels (~140 MB).
PYTHON312 ?= $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
GPU_VENV := .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed

$(GPU_STAMP): requirements-base.txt requirements-gpu.txt requirements-test.txt pyproject.toml
	@test -n "$(PYTHON312)" || { echo "make: Python 3.12 not found; set PYTHON312=/path/to/python3.12" >&2; exit 2; }
	test -x $(GPU_PY) || $(PYTHON312) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q --upgrade pip
	$(GPU_PY) -m pip install -q -r requirements-gpu.txt
	grep -E '^(pytest|pytest-xdist|tensorboard|ruff)==' requirements-test.txt > $(GPU_VENV)/test-tools.txt
	$(GPU_PY) -m pip install -q -r $(GPU_VENV)/test-tools.txt
	$(GPU_PY) -m pip install -q --no-deps -e .
	touch $(GPU_STAMP)

# The suite on jax 0.11.2 (the GPU machine's jax), on CPU.
test-jax011: $(GPU_STAMP)
	PIPELINERL_WITHOUT_TORCH=1 $(GPU_PY) -m pytest -q -n 2 --dist loadfile tests

# The decode chunk (Triton kernel in the program), the train step and the publish path compiled
# for H100 topologies on this CPU machine: bench/results/h100_compile.json. ARGS: e.g. --quick.
compile-h100: $(GPU_STAMP)
	$(GPU_PY) bench/compile_h100.py $(ARGS)

# The wheels the lent GPU machine lacks (Python 3.12, manylinux x86_64) into .whl/, for
# bench/gpu_check.sh to install there (docs/gpu_check.md); fails above 60 MiB with the tree.
gpu-bundle:
	bash bench/gpu_bundle.sh

# On an NVIDIA GPU machine: the gpu-marked tests (the Triton kernel through jax-triton against
# the reference), which fail (not skip) there when the GPU stack is missing.
test-gpu: $(GPU_STAMP)
	PIPELINERL_REQUIRE_GPU=1 $(GPU_PY) -m pytest -q -m gpu tests

# Google's Tunix (google-tunix 0.1.7) for bench/bench_vs_tunix.py, in a venv of its own: it
# needs safetensors < 0.8 and requirements-base.txt pins 0.8.0. Not part of `make test`: ~1.6 GB.
TUNIX_VENV := .venv-tunix
TUNIX_PY := $(TUNIX_VENV)/bin/python
TUNIX_STAMP := $(TUNIX_VENV)/.installed

$(TUNIX_STAMP): requirements-tunix.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Tunix needs Python 3.11 or newer; set PYTHON=python3.11"'
	test -x $(TUNIX_PY) || $(PYTHON) -m venv $(TUNIX_VENV)
	$(TUNIX_PY) -m pip install -q --upgrade pip
	$(TUNIX_PY) -m pip install -q -r requirements-tunix.txt
	touch $(TUNIX_STAMP)

tunix-venv: $(TUNIX_STAMP)

# Every peer figure this machine kind lacks (bench/machine_pass.py), after installing what the
# peers need: the real model, TRL (requirements-bench.txt), Tunix's venv. ARGS: e.g. --list.
# The peers' installs may fail (`-`): the pass then runs every step that needs neither and
# names the command that installs what is missing.
machine-pass: real-model
	-$(PY) -m pip install -q -r requirements-bench.txt
	-$(MAKE) --no-print-directory tunix-venv
	$(PY) bench/machine_pass.py $(ARGS)

real-model: $(STAMP)
	$(PY) -m pipelinerl_jax.models.real_model --out=models/SmolLM2-135M-Instruct

# The real model learns math (configs/smollm2_math.py); fetches the model first if needed.
run-real: real-model
	$(PY) launch.py --config=configs/smollm2_math.py --workdir=runs/smollm2-$$(date +%Y%m%d-%H%M%S) $(ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) $(TUNIX_VENV) .pytest_cache
