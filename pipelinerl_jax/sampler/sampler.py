"""PagedSampler: the pipeline's sampler (submit, step one chunk, collect samples), on this
process's devices. It implements the Sampler protocol (protocol.py), which is all the pipeline
uses of it; `warm_up`, `generate` and the sizes below are its own.

    sampler = PagedSampler(graphdef, params, SamplerConfig(num_slots=64),
                           eos_token_ids=tok.eos_token_ids)
    sampler.submit(prompt_ids, n=8, params=SamplingParams(temperature=1.0, max_new_tokens=512))
    while sampler.has_work():
        for sample in sampler.step():      # one decode chunk; finished samples come back
            ...
    sampler.set_params(new_params, version)   # any thread; swapped at the next chunk boundary

One `step()`: swap staged params (kv policy "keep": the cache stays; "recompute": running
sequences are re-prefilled with the new params), reserve pages for the chunk (preempting if
the pool runs out), admit waiting groups (prefill + page copies), run one jitted decode chunk
of `chunk_steps` steps, and retire finished sequences. Bad requests do not raise: they come back
as samples with finish_reason "error" and a one-line message, and the rest proceed.

Stop strings (`SamplingParams.stop_strings`) need `detokenize` (token ids -> text): the
scheduler matches them on the host after each chunk (scheduler.py).

A preempted sequence keeps its tokens, logprobs and versions; when resumed, its prompt and
generated tokens are re-prefilled with the params current at that time (its K/V is
recomputed whatever the kv policy). Only `set_params` and `prepare` may be called from
another thread.

Mesh: a 1-D ("data",) mesh splits slots data-parallel with params replicated; a 2-D
("data", "tp") mesh also splits params and the KV pool tensor-parallel (engine.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as Ps

from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder
from pipelinerl_jax.sampler import packing
from pipelinerl_jax.sampler import pages as pg
from pipelinerl_jax.sampler.config import SamplerConfig, width_ladder
from pipelinerl_jax.sampler.engine import get_engine
from pipelinerl_jax.sampler.param_view import ParamView
from pipelinerl_jax.sampler.protocol import Sample  # what step() returns; importable here too
from pipelinerl_jax.sampler.requests import observation_error, request_error
from pipelinerl_jax.sampler.scheduler import Scheduler
from pipelinerl_jax.sampler.sequence import PrefillRow, SamplingParams, Sequence
from pipelinerl_jax.sampler.state import SLOT_FIELDS, init_state
from pipelinerl_jax.sampler.statics import EngineConfig, pick_window, pool_dtype


def _mix32(*values: int) -> int:
    """Deterministic 32-bit hash of integers (splitmix-style), for per-attempt seeds."""
    h = 0x9E3779B9
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0xFFFFFFFF


class PagedSampler:
    """Continuous-batching generation over a paged KV cache with in-flight param swaps (a
    `protocol.Sampler`)."""

    def __init__(
        self,
        graphdef,
        params,
        config: SamplerConfig = SamplerConfig(),
        *,
        version: int = 0,
        eos_token_ids=(),
        mesh=None,
        detokenize=None,
        share_base: PagedSampler | None = None,
    ):
        """detokenize: token ids -> text (e.g. `lambda ids: tokenizer.decode(ids,
        skip_special_tokens=False)`), needed by requests with stop strings. share_base: with
        LoRA, a sampler of the same model and mesh whose converted base this one reads (then
        `params` may be the adapters alone): a second sampler, say for evaluation, adds only
        its adapters and KV pool."""
        cfg = config
        model_cfg = decoder.config_of(graphdef)  # cfg checked itself when it was built
        if cfg.compute_dtype not in (None, model_cfg.compute_dtype):
            # The engine reads its model config from the graphdef: one with the sampler's
            # compute dtype makes decode cast the (trainer's) params to it at conversion.
            model_cfg = dataclasses.replace(model_cfg, compute_dtype=cfg.compute_dtype)
            graphdef = _graphdef_of(model_cfg)
        self.config, self.model_cfg = cfg, model_cfg
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        shards = 1 if mesh is None else mesh.shape[cfg.data_axis]
        cfg.check_shards(shards)
        pages_per_slot = pg.max_pages_per_slot(cfg.max_seq_len, cfg.page_size)
        self.pool = pg.sampler_pool(cfg, model_cfg, shards=shards)
        num_pages = self.pool.num_pages
        logging.info("%s", pg.describe_pool(self.pool, cfg.num_slots))
        self.engine = get_engine(
            graphdef,
            EngineConfig(
                num_slots=cfg.num_slots,
                page_size=cfg.page_size,
                num_pages=num_pages,
                pages_per_slot=pages_per_slot,
                max_stop_tokens=cfg.max_stop_tokens,
                cache_dtype=pg.cache_dtype(cfg, model_cfg),
                head_dtype=cfg.head_dtype or "float32",
                truncated_logprobs=cfg.truncated_logprobs,
                attention=cfg.attention,
            ),
            mesh=mesh,
            data_axis=cfg.data_axis,
            tp_axis=cfg.tp_axis,
        )
        self.scheduler = Scheduler(
            num_slots=cfg.num_slots,
            num_pages=num_pages,
            page_size=cfg.page_size,
            pages_per_slot=pages_per_slot,
            max_stop_tokens=cfg.max_stop_tokens,
            num_shards=shards,
            detokenize=detokenize,
        )
        self.state = init_state(
            num_layers=model_cfg.num_layers,
            num_pages=num_pages,
            page_size=cfg.page_size,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            pool_dtype=pool_dtype(self.engine.ecfg),
            num_slots=cfg.num_slots,
            pages_per_slot=pages_per_slot,
            max_stop_tokens=cfg.max_stop_tokens,
            chunk_steps=cfg.chunk_steps,
            seed=cfg.seed,
            shardings=self.engine.shardings,
        )
        self._view = ParamView(
            self.engine, model_cfg, params, share=None if share_base is None else share_base._view
        )
        self.params = self._view.convert(params, copy=False)
        self.version = int(version)
        self._staged = None
        self._lock = threading.Lock()
        self._errors: list[Sample] = []
        self._next_request = 0
        # decode_slot_steps: rows the decode chunks ran (tokens decoded / it = slot use).
        self.stats = dict(
            chunks=0,
            decode_tokens=0,
            decode_slot_steps=0,
            prefill_tokens=0,
            preemptions=0,
            swaps=0,
        )

    # --- requests -------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids,
        *,
        n: int = 1,
        params: SamplingParams = SamplingParams(),
        request_id: int | None = None,
        episode: bool = False,
    ) -> int:
        """Queues n attempts of one prompt; returns the request id.

        Invalid requests come back from the next step() as error samples. episode: each
        attempt's turn, once finished, stays parked with its KV pages for `resume` (the next
        turn) or `release`.
        """
        if not 1 <= n <= self.config.num_slots:
            raise ConfigError(
                f"n={n} attempts per prompt must be between 1 and num_slots="
                f"{self.config.num_slots}: raise num_slots or lower n"
            )
        rid = self._next_request if request_id is None else int(request_id)
        self._next_request = max(self._next_request, rid + 1)
        prompt = [int(t) for t in prompt_ids]
        stop_ids = tuple(dict.fromkeys(self.eos_token_ids + tuple(params.stop_token_ids)))
        error = request_error(
            prompt,
            params,
            stop_ids,
            config=self.config,
            vocab_size=self.model_cfg.vocab_size,
            capacity_tokens=self.scheduler.capacity_tokens(),
            can_detokenize=self.scheduler.detokenize is not None,
        )
        seqs = []
        for attempt in range(n):
            seed = (
                _mix32(params.seed, attempt)
                if params.seed is not None
                else _mix32(self.config.seed, rid, attempt)
            )
            limit = min(
                len(prompt) + params.max_new_tokens,
                self.config.max_seq_len,
                self.scheduler.capacity_tokens() + 1,
            )
            seqs.append(
                Sequence(
                    request_id=rid,
                    attempt=attempt,
                    prompt=prompt,
                    params=params,
                    seed=seed,
                    limit=limit,
                    stop_ids=stop_ids,
                    keep=episode,
                )
            )
        if error:
            self._errors.extend(self._to_sample(s, error=error) for s in seqs)
        else:
            self.scheduler.enqueue(seqs)
        return rid

    def resume(
        self, request_id: int, attempt: int, observation_ids, *, max_new_tokens: int
    ) -> None:
        """The next turn of a parked episode: `observation_ids` (the environment's answer,
        already tokenized) are appended and decoding goes on for up to `max_new_tokens`, on
        the KV pages the episode kept: only the new tokens are prefilled. Observation tokens
        come back with version -1 and logprob 0; stop strings match the new turn's text only.
        A bad observation (unknown episode, token out of the vocabulary, no room left) ends
        the episode: the next step() returns it as an error sample."""
        key = (int(request_id), int(attempt))
        seq = self.scheduler.parked.get(key)
        if seq is None:
            raise KeyError(f"episode {key} is not parked (finished, released, or never submitted)")
        tokens = [int(t) for t in observation_ids]
        cap = min(self.config.max_seq_len, self.scheduler.capacity_tokens() + 1)
        error = observation_error(
            seq.length, tokens, max_new_tokens, vocab_size=self.model_cfg.vocab_size, cap=cap
        )
        if error:
            self.scheduler.drop(key)
            self._errors.append(self._to_sample(seq, error=error))
            return
        limit = min(seq.length + len(tokens) + max_new_tokens, cap)
        self.scheduler.resume(key, tokens, limit)

    def release(self, request_id: int, attempt: int) -> None:
        """Ends a parked episode (its last turn is done): its pages return to the pool."""
        self.scheduler.drop((int(request_id), int(attempt)))

    @property
    def num_parked(self) -> int:
        return len(self.scheduler.parked)

    def has_work(self) -> bool:
        return bool(self._errors) or self.scheduler.has_work()

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # --- params ---------------------------------------------------------------------------

    def base_for_trainer(self):
        """LoRA: this sampler's base view for a trainer on its device (ParamView's)."""
        return self._view.base_for_trainer()

    def prepare(self, params):
        """The engine's per-layer view of model `params` on the sampler mesh, on a private
        copy (dispatched, not waited for): the same shapes and shardings for every version, so
        a swap never recompiles. With LoRA, `params` may be the adapters alone (param_view.py).
        Any thread may call it; the pipeline's publisher does, in the trainer thread, so the
        sampler's chunk boundary only swaps a reference."""
        # copy: where sampler and trainer share a device the placement would otherwise be the
        # trainer's own buffers, which its next step donates.
        return self._view.convert(params, copy=True)

    def set_params(self, params, version: int, *, prepared: bool = False) -> None:
        """Stages new params (thread-safe); the next step() swaps them in.

        Model params are converted here (`prepare`, in the caller's thread); `prepared=True`
        takes the output of `prepare` as it is.
        """
        if prepared:
            if jax.tree.structure(params) != jax.tree.structure(self.params):
                raise ConfigError(
                    f"set_params(version={version}, prepared=True): not the "
                    "output of this sampler's prepare()"
                )
            placed = params
        else:
            placed = self._view.convert(params, copy=False)
        with self._lock:
            self._staged = (placed, int(version))

    def _swap_if_staged(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return
        self.params, self.version = staged
        self.stats["swaps"] += 1
        if self.config.kv_policy == "recompute":
            self._run_prefill(self.scheduler.recompute_rows())
            self.scheduler.evict_all_parked()

    # --- one chunk ------------------------------------------------------------------------

    def step(self) -> list[Sample]:
        """Runs one chunk boundary + decode chunk; returns the samples that finished."""
        finished, self._errors = self._errors, []
        k = self.config.chunk_steps
        self._swap_if_staged()
        sched = self.scheduler
        self.stats["preemptions"] += len(sched.reserve(k))
        if self.config.decode_widths > 1:
            sched.compact()  # before admission, which then fills the slots above
        rows, copies = sched.admit(k, self.version)
        self._run_prefill(rows)
        self._run_copies(copies)
        running = sched.running
        if not running:
            if sched.waiting:
                # Unreachable while _make_room frees every cache a queue head could need; if
                # it ever is reached, fail the run here rather than spin on an empty chunk.
                raise RuntimeError(
                    f"sampler stalled: {sched.num_waiting} sequences wait, none runs, "
                    f"{[a.num_free for a in sched.allocators]} pages free per shard "
                    "(a scheduler bug: please report it with this line)"
                )
            return finished
        self._upload()
        needed = max(
            pg.pages_for(sched.kv_after_chunk(s, k), self.config.page_size) for s in running
        )
        window = pick_window(max(needed, self.config.min_window_pages), sched.pages_per_slot)
        width = self._width()
        self.state = self.engine.decode_chunk(
            self.params, self.state, np.int32(self.version), k=k, window=window, width=width
        )
        self.stats["decode_slot_steps"] += k * sched.num_shards * (width or sched.slots_per_shard)
        st = self.state
        out = jax.device_get(
            (st.out_tokens, st.out_logprobs, st.out_versions, st.out_valid, st.active)
        )
        self.stats["chunks"] += 1
        self.stats["decode_tokens"] += int(out[3].sum())
        done = sched.record(*out)
        finished.extend(self._to_sample(s) for s in done)
        return finished

    def _widths(self) -> list[int | None]:
        """The slots per shard a decode chunk may run, widest first: a shard's slots (None),
        then `decode_widths` - 1 halvings of it (validated at construction)."""
        return [None, *width_ladder(self.scheduler.slots_per_shard, self.config.decode_widths)[1:]]

    def _width(self) -> int | None:
        """Slots per shard the next chunk decodes: the narrowest width that holds every
        running sequence (the scheduler packed them into the lowest slots)."""
        used = self.scheduler.occupied_width()
        return [w for w in self._widths() if w is None or w >= used][-1]

    def generate(
        self, prompts, *, n: int = 1, params: SamplingParams = SamplingParams(), progress=None
    ) -> list[Sample]:
        """Submits every prompt, runs to completion; samples ordered by (request, attempt)."""
        ids = [self.submit(p, n=n, params=params) for p in prompts]
        wanted, results = set(ids), []
        while self.has_work():
            done = [s for s in self.step() if s.request_id in wanted]
            results.extend(done)
            if progress is not None and done:
                progress(len(done))
        return sorted(results, key=lambda s: (s.request_id, s.attempt))

    # --- device work ----------------------------------------------------------------------

    def _upload(self) -> None:
        sched = self.scheduler
        if not sched.dirty:
            return
        shardings = self.engine.shardings
        self.state = self.state.replace(
            **{
                name: jax.device_put(sched.mirror[name].astype(dtype), getattr(shardings, name))
                for name, dtype in SLOT_FIELDS.items()
            }
        )
        sched.dirty = False

    def _rows_sharding(self):
        return NamedSharding(self.engine.mesh, Ps(self.config.data_axis))

    def _run_prefill(self, rows: list[PrefillRow]) -> None:
        """Chunked, batched prefill of rows (packing.prefill_pieces)."""
        for piece in packing.prefill_pieces(rows, self.scheduler, self.config):
            self._prefill_piece(piece)
            self.stats["prefill_tokens"] += piece.num_tokens

    def _prefill_piece(self, piece: packing.PrefillPiece) -> None:
        put = lambda a: jax.device_put(a, self._rows_sharding())  # noqa: E731
        self.state = self.engine.prefill(
            self.params,
            self.state,
            put(piece.tokens_RxT),
            put(piece.positions_RxT),
            put(piece.tables_RxM),
            window=piece.window,
        )

    def warm_up(self) -> int:
        """Compiles now what a run would otherwise compile mid-run, by running it on empty
        rows (padding positions and inactive slots write only to the null page); returns how
        many shapes ran. Two kinds:

        - With `prefill_pad_tokens`, every prefill shape a first piece can take: [rows,
          prefill_chunk] with rows a power of two up to the rows a shard can prefill at once.
          Without it the token length varies too, and shapes compile on first use. Prompts
          longer than prefill_chunk also prefill later pieces, each with its attention window:
          those still compile on first use.
        - With `decode_widths` > 1 and one attention window (`min_window_pages` covers a
          slot's table), the decode chunk at every width."""
        return self._warm_prefill() + self._warm_decode()

    def _warm_decode(self) -> int:
        cfg, sched = self.config, self.scheduler
        if cfg.decode_widths == 1 or cfg.min_window_pages < sched.pages_per_slot:
            return 0
        assert not sched.running, "warm_up() runs before the first request"
        widths = self._widths()
        for width in widths:
            self.state = self.engine.decode_chunk(
                self.params,
                self.state,
                np.int32(self.version),
                k=cfg.chunk_steps,
                window=sched.pages_per_slot,
                width=width,
            )
        jax.block_until_ready(self.state)
        return len(widths)

    def _warm_prefill(self) -> int:
        pieces = packing.padding_pieces(self.scheduler, self.config)
        for piece in pieces:
            self._prefill_piece(piece)
        jax.block_until_ready(self.state)
        return len(pieces)

    def _run_copies(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = packing.copy_arrays(copies, self.scheduler)
        sharding = self._rows_sharding()
        self.state = self.engine.copy_pages(
            self.state, jax.device_put(src, sharding), jax.device_put(dst, sharding)
        )

    def _to_sample(self, seq: Sequence, error: str | None = None) -> Sample:
        return Sample(
            request_id=seq.request_id,
            attempt=seq.attempt,
            prompt_ids=seq.prompt,
            token_ids=list(seq.tokens),
            logprobs=list(seq.logprobs),
            versions=list(seq.versions),
            start_version=seq.start_version,
            finish_reason="error" if error else seq.finish_reason,
            error=error,
            preemptions=seq.preemptions,
        )


@functools.cache
def _graphdef_of(model_cfg):
    """One graphdef per config, so samplers of one config share an engine (engine.py keys
    its cache on the graphdef)."""
    return decoder.abstract_init(model_cfg)[0]
