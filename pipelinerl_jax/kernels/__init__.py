"""Paged decode attention over the sampler's KV pool (docs/triton_kernel.md).

- paged_attention.py         the one entry point: the Triton kernel on NVIDIA GPUs, else the
                             jnp reference
- paged_attention_triton.py  the Triton kernel and the one function computing its launch
- paged_attention_ref.py     the pure-jnp reference: the oracle for the kernel's tests
"""
