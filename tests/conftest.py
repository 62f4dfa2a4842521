"""Shared pytest setup: CPU-only JAX, deterministic Triton settings, no network."""

import importlib.util
import os
import re
import shutil
import tempfile

from tests.xla_env import with_fast_compile

# Tests run on CPU even where a GPU is visible, unless a test opts into the GPU explicitly.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Triton 3.9 warns that its fp-fusion default flips in 3.10: pin it so results do not drift.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# Hugging Face libraries must never reach for the hub in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# LLVM optimisation off for the tests and every process they start (tests/xla_env.py says why);
# an XLA_FLAGS that chooses a level itself wins.
os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))
# One persistent compilation cache for the whole suite, fresh each run (as on CI's clean
# machine; never the user's ~/.cache). The processes a test launches store every executable
# that took 0.1 s or more to compile, not only those over the 1 s a real model's run stores:
# the tiny configs' launches compile the same decode chunks, prefills and train steps in dozens
# of processes, and loading them made the launching tests ~10% quicker (test_distributed_learns
# + test_pipeline_resume, alternating: 61-63 s against 69-70). The test processes themselves
# keep 1 s: the runs a test makes in its own process compile programs few others load, and
# storing them made those tests ~5% slower (test_pipeline_api + _text_task + _episodes: 38.7
# and 42.1 s against 36.3 and 40.2). Set here, in the process that starts the xdist workers,
# so they and what they launch share the folder.
if "PIPELINERL_JAX_CACHE" not in os.environ:
    _SUITE_CACHE = tempfile.mkdtemp(prefix="pipelinerl_jax_suite_cache_")
    os.environ["PIPELINERL_JAX_CACHE"] = _SUITE_CACHE
else:
    _SUITE_CACHE = None  # the user's (or the controlling process's): left in place
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")  # for launches

import jax  # noqa: E402  (after the variables above: JAX reads JAX_PLATFORMS when imported)

jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # for this process

# `make test-jax011` runs the suite on jax 0.11 (Python 3.12), where the registry serves torch
# only as its CUDA build (gigabytes of NVIDIA wheels). There PIPELINERL_WITHOUT_TORCH=1 leaves
# out the modules that import a peer this venv lacks (torch, transformers; triton where it is
# missing), and the summary names them. Elsewhere a missing torch fails as it should.
_WITHOUT_TORCH = os.environ.get("PIPELINERL_WITHOUT_TORCH") == "1"
_MISSING = [m for m in ("torch", "transformers", "triton") if importlib.util.find_spec(m) is None]
_TORCH_USERS = re.compile(
    rf"^\s*(import|from) ({'|'.join(_MISSING) or '$^'})\b"
    r"|^from tests\.tiny_models import .*\b(hf_greedy|save_hf_llama)\b",
    re.M,
)


def _needs_torch(path) -> bool:
    return path.name.startswith("test_") and bool(_TORCH_USERS.search(path.read_text()))


def pytest_ignore_collect(collection_path, config):
    if _WITHOUT_TORCH and collection_path.suffix == ".py" and _needs_torch(collection_path):
        return True
    return None


def pytest_unconfigure(config):
    if _SUITE_CACHE is not None:  # only the process that made the folder removes it
        shutil.rmtree(_SUITE_CACHE, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, config):
    # Counted here, not while collecting: under xdist the workers collect.
    if _WITHOUT_TORCH:
        left_out = sorted(
            p.name for p in (config.rootpath / "tests").glob("*.py") if _needs_torch(p)
        )
        terminalreporter.write_line(
            f"PIPELINERL_WITHOUT_TORCH=1: {len(left_out)} modules that need torch left out: "
            + " ".join(left_out)
        )


# The modules that each keep an xdist worker busy longest (several processes launched and
# killed; minutes of the suite's ~14). `make test` hands whole modules to 2 workers in
# collection order, so started first they overlap with the rest instead of running alone at the
# end. `make test` prints the slowest tests: keep this list in step with them.
_LONGEST_FIRST = (  # longest first (seconds of one module in a cold-cache `make test`)
    "test_distributed_trainers.py",  # 96
    "test_distributed_launch.py",  # 82
    "test_pipeline_resume.py",  # 68
    "test_distributed_elastic.py",  # 60
    "test_lora_shared_base.py",  # 57
    "test_pipeline_deterministic.py",  # 54
    "test_pipeline_resume_episodes.py",  # 49
    "test_readme_env.py",  # 49
    "test_gguf_io.py",  # 47
    "test_distributed_no_supervisor.py",  # 47
    "test_rl_composition.py",  # 46
    "test_lora_pipeline.py",  # 43
    "test_docs.py",  # 40
    "test_distributed_rollouts.py",  # 36
    "test_lora_distributed.py",  # 34
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: others keep order
