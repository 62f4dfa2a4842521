"""The sampler: paged KV cache, continuous batching, decode between weight swaps.

- protocol.py    the Sampler protocol the pipeline uses, and the Sample it returns
- sampler.py     PagedSampler: submit, step one chunk, collect finished samples
- scheduler.py   continuous batching on the host (admission, preemption, retirement)
- sequence.py    SamplingParams, and the Sequence and PrefillRow records the scheduler moves
- stop_strings.py  where a turn ends on a stop string
- pages.py       the host-side page allocator and pool sizing
- config.py      SamplerConfig: one sampler's sizes and policies
- statics.py     what a compiled engine depends on: EngineConfig, MeshAxes, window buckets
- steps.py       the jittable device steps (decode_chunk, prefill, copy_pages,
                 state_from_prompts), free functions over SamplerState; `apply=` decodes a
                 model of your own
- engine.py      the Engine: those steps compiled once per shape under shard_map
- state.py       SamplerState, the pytree a decode chunk reads and writes, and its shardings
- forward.py     the model's block unrolled over per-layer params, in the strategy's layout
- strategies.py  decode attention strategies (staged: CPU, paged: GPU/Triton, gather)
- attend.py      attention hooks over the page pool and the writes into it
- staged.py      the staged strategy's dense window copy
- sampling.py    greedy / temperature / top-k / top-p sampling and behaviour logprobs
"""
