"""The talk's two measured inputs, taken from our own sampler engine and trainer.

- `decode_latency`: seconds per decode step of `sampler.engine.Engine.decode_chunk` with b
  sequences decoding at once, each starting at `context_len` tokens of context. The attention
  window is fixed at the pages covering context_len plus every timed step (one compile per
  batch size), so attention reads about context_len + (repeats + 2)·chunk_steps positions. It is
  the forward latency per batch size the talk asks for; the host-side scheduler's work between
  chunks is not included.
- `train_throughput`: tokens/s of `trainer.Trainer.train_step` on packed rows of random
  samples. The planner's consumption rate compares trainer throughput with generated tokens, so
  the profile stores completion tokens/s (prompt tokens cost trainer time but are not
  generated); packed tokens/s is stored beside it.

Both run on the first local device, i.e. they are per-device numbers.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from pipelinerl_jax.models import config_json, decoder, param_counts
from pipelinerl_jax.plan.layout import kv_cache_max_batch
from pipelinerl_jax.plan.measure import measure_decode_latency, measure_train_throughput
from pipelinerl_jax.plan.utilisation import PlanError
from pipelinerl_jax.rl.batch import ScoredSample, build_batch
from pipelinerl_jax.rl.config import BatchConfig
from pipelinerl_jax.sampler import engine as eng
from pipelinerl_jax.sampler import steps
from pipelinerl_jax.sampler.state import SLOT_FIELDS, init_state
from pipelinerl_jax.train import trainer as tr

# The embedded default model's family at a size a CPU times in seconds.
TINY_HF_CONFIG = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def tiny_model(seed: int = 0, **overrides):
    """(graphdef, params) of a small random Llama for measurement."""
    cfg = config_json.from_hf({**TINY_HF_CONFIG, **overrides})
    return decoder.init(cfg, jax.random.key(seed))


def _full_state(engine: eng.Engine, batch: int, context_len: int, capacity: int, chunk_steps: int):
    """A sampler state with `batch` active slots at `context_len` tokens, room for `capacity`."""
    cfg = engine.model_cfg
    ecfg = engine.ecfg
    state = init_state(
        num_layers=cfg.num_layers,
        num_pages=ecfg.num_pages,
        page_size=ecfg.page_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        pool_dtype=steps.pool_dtype(ecfg),
        num_slots=batch,
        pages_per_slot=ecfg.pages_per_slot,
        max_stop_tokens=ecfg.max_stop_tokens,
        chunk_steps=chunk_steps,
        seed=0,
        shardings=engine.shardings,
    )
    m = ecfg.pages_per_slot
    rng = np.random.default_rng(batch)
    host = {
        "block_tables": 1 + np.arange(batch * m, dtype=np.int32).reshape(batch, m),
        "last_token": rng.integers(0, cfg.vocab_size, batch).astype(np.int32),
        "lengths": np.full(batch, context_len, np.int32),
        "limit": np.full(batch, capacity, np.int32),
        "active": np.ones(batch, np.bool_),
        "temperature": np.ones(batch, np.float32),
        "top_k": np.zeros(batch, np.int32),
        "top_p": np.ones(batch, np.float32),
        "stop_tokens": np.full((batch, ecfg.max_stop_tokens), -1, np.int32),  # never stop
        "seeds": np.arange(batch, dtype=np.uint32),
    }
    return state.replace(
        **{
            k: jax.device_put(v.astype(SLOT_FIELDS[k]), getattr(engine.shardings, k))
            for k, v in host.items()
        }
    )


def decode_latency(
    graphdef,
    params,
    batch_sizes,
    *,
    context_len: int = 128,
    page_size: int = 16,
    chunk_steps: int = 8,
    repeats: int = 3,
    cache_dtype: str | None = None,
) -> list[float]:
    """Seconds per decode step at each batch size (fastest of `repeats` chunks)."""
    cfg = decoder.config_of(graphdef)
    if context_len < 1:
        raise PlanError(f"--context_len={context_len}: must be >= 1")
    # Room for the warm-up chunk and the timed ones; lengths grow by chunk_steps per call.
    capacity = context_len + (repeats + 2) * chunk_steps + 1
    pages_per_slot = math.ceil(capacity / page_size)

    def make_chunk(batch: int):
        ecfg = steps.EngineConfig(
            num_slots=batch,
            page_size=page_size,
            num_pages=batch * pages_per_slot + 1,
            pages_per_slot=pages_per_slot,
            max_stop_tokens=1,
            cache_dtype=cache_dtype or cfg.compute_dtype,
        )
        engine = eng.get_engine(graphdef, ecfg)
        # The engine's own view of the params, placed as the Sampler places them.
        dparams = engine.prepare_params(jax.device_put(params, engine.replicated))
        # out_* fields sized for the chunk: the output state then matches the input and the
        # warm-up call is the only compile.
        box = [_full_state(engine, batch, context_len, capacity, chunk_steps)]
        version = np.int32(0)

        def chunk():
            box[0] = engine.decode_chunk(
                dparams, box[0], version, k=chunk_steps, window=pages_per_slot
            )  # state donated
            jax.block_until_ready(box[0].lengths)

        return chunk

    per_chunk = measure_decode_latency(make_chunk, batch_sizes, repeats=repeats)
    return [t / chunk_steps for t in per_chunk]


def train_throughput(
    graphdef,
    params,
    *,
    rows: int = 4,
    seq_len: int = 128,
    prompt_len: int = 8,
    repeats: int = 3,
    trainer_config=None,
) -> dict:
    """Trainer tokens/s on one device: completion (generated) and packed tokens per second."""

    if not 1 <= prompt_len < seq_len:
        raise PlanError(
            f"train probe: prompt_len={prompt_len} must be in 1..seq_len-1={seq_len - 1}"
        )
    cfg = decoder.config_of(graphdef)
    rng = np.random.default_rng(0)
    comp = seq_len - prompt_len
    samples = [
        ScoredSample(
            prompt_tokens=rng.integers(0, cfg.vocab_size, prompt_len).tolist(),
            completion_tokens=rng.integers(0, cfg.vocab_size, comp).tolist(),
            completion_logprobs=(-rng.uniform(0.5, 5.0, comp)).tolist(),
            completion_versions=[0] * comp,
            reward=float(rng.uniform()),
            group_id=i // 2,
        )
        for i in range(rows)
    ]
    batch, _ = build_batch(
        samples,
        BatchConfig(seq_len=seq_len, num_rows=rows, max_sequences=rows, max_sequence_len=seq_len),
    )
    mesh = tr.trainer_mesh(jax.devices()[:1])
    trainer = tr.Trainer(
        trainer_config or tr.TrainerConfig(), graphdef, jax.eval_shape(lambda: params), mesh
    )
    box = [trainer.init_state(params)]
    dev_batch = trainer.put_batch(batch)

    def step():
        box[0], metrics = trainer.train_step(box[0], dev_batch)  # state donated
        jax.block_until_ready(metrics)

    completion_tps = measure_train_throughput(step, rows * comp, repeats=repeats)
    return {
        "tokens_per_s_per_device": completion_tps,
        "packed_tokens_per_s": completion_tps * seq_len / comp,
        "config": {
            "rows": rows,
            "seq_len": seq_len,
            "prompt_len": prompt_len,
            "repeats": repeats,
            "statistic": "min",
        },
    }


def device_memory_bytes() -> int | None:
    """Memory of the first device as the runtime reports it (None on CPU)."""
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def engine_profile(
    graphdef,
    params,
    *,
    decode_batch_sizes,
    context_len: int = 128,
    chunk_steps: int = 8,
    train_rows: int = 4,
    train_seq_len: int = 128,
    repeats: int = 3,
    memory_bytes: int | None = None,
    source: str = "",
) -> dict:
    """The profile's 'decode' and 'train' sections (plus the KV-cache bound when memory is known)."""

    cfg = decoder.config_of(graphdef)
    sizes = sorted({int(b) for b in decode_batch_sizes})
    if not sizes or sizes[0] < 1:
        raise PlanError(f"--decode_batch_sizes={list(decode_batch_sizes)}: need positive sizes")
    latency = decode_latency(
        graphdef, params, sizes, context_len=context_len, chunk_steps=chunk_steps, repeats=repeats
    )
    model_desc = {
        "source": source,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "params": param_counts.num_params(cfg),
        "dtype": cfg.compute_dtype,
    }
    decode = {
        "batch_sizes": sizes,
        "latency_s": latency,
        "context_len": context_len,
        "chunk_steps": chunk_steps,
        "statistic": "min",
        "model": model_desc,
    }
    memory_bytes = memory_bytes or device_memory_bytes()
    if memory_bytes:
        param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        decode["kv_max_batch"] = kv_cache_max_batch(
            memory_bytes=memory_bytes,
            param_bytes=param_bytes,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            context_len=context_len,
            bytes_per_element=np.dtype(cfg.compute_dtype).itemsize,
        )
        decode["memory_bytes"] = memory_bytes
    train = train_throughput(
        graphdef, params, rows=train_rows, seq_len=train_seq_len, repeats=repeats
    )
    train["model"] = model_desc
    return {"decode": decode, "train": train}
