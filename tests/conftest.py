"""Shared pytest setup: CPU-only JAX, deterministic Triton settings, no network."""

import os

# Tests run on CPU even where a GPU is visible, unless a test opts into the GPU explicitly.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Triton 3.9 warns that its fp-fusion default flips in 3.10: pin it so results do not drift.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# Hugging Face libraries must never reach for the hub in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
