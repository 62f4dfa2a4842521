# Two commands: `make run` (the main job) and `make test`. Each sets itself up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-gpu bench clean real-model run-real

$(STAMP): requirements.txt requirements-test.txt pyproject.toml
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
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# NVIDIA GPU machine (CUDA 12) only: adds requirements-gpu.txt (jax CUDA plugin, jax-triton) to
# the venv and runs the gpu-marked tests, which fail (not skip) here when the GPU stack is missing.
# `make test` never installs these.
test-gpu: $(STAMP)
	$(PY) -m pip install -q -r requirements.txt -r requirements-gpu.txt
	PIPELINERL_REQUIRE_GPU=1 $(PY) -m pytest -q -m gpu tests

real-model: $(STAMP)
	$(PY) -m pipelinerl_jax.models.real_model --out=models/SmolLM2-135M-Instruct

# The real model learns math (configs/smollm2_math.py); fetches the model first if needed.
run-real: real-model
	$(PY) launch.py --config=configs/smollm2_math.py --workdir=runs/smollm2-$$(date +%Y%m%d-%H%M%S) $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
