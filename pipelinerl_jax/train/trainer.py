"""The train state and the one jitted train step: (state, batch) -> (state, metrics).

The step runs on a trainer mesh with axes ("fsdp", "tp"): params and optimizer moments are
sharded by the logical-axis rules of pipelinerl_jax.sharding, batch rows are split over "fsdp".
It is compiled once, with explicit in/out shardings, and donates the old state. Inside:
gradient accumulation over micro-batches with lax.scan (f32 accumulators; with the built-in
loss the backward adds the layers' gradients into the accumulator in place,
models/accumulating_scan.py, so no second full gradient is held), the loss
(`rl_loss`, train/loss_fn.py: the model forward and the registered objective of
rl/objectives.py), global-norm clipping, then optax AdamW (warm-up + cosine or constant, no decay on norms and
biases). Moments are always f32: the optimizer sees f32 views of the params and the update is
cast back, so bf16 params work. A non-finite loss or gradient skips the update (the state is
returned unchanged apart from its counters); `check_skips` on the host stops the run after too
many skips in a row.

Three pieces can be swapped without editing the library: `Trainer(..., loss_fn=, optimizer=,
rules=)` takes a `loss_fn(params, batch) -> (loss, aux)` (LossFn), any optax
GradientTransformation in place of AdamW, and logical-axis rules in place of sharding.RULES
(the mesh must then use only the mesh axes those rules name).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pipelinerl_jax import sharding
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models import decoder, lora, shared_base
from pipelinerl_jax.rl import lag, losses
from pipelinerl_jax.rl.batch import SEQUENCE_FIELDS, TOKEN_FIELDS, TrainBatch
from pipelinerl_jax.rl.config import linear_schedule
from pipelinerl_jax.train.config import TrainerConfig
from pipelinerl_jax.train.loss_fn import LossFn as LossFn  # re-exported
from pipelinerl_jax.train.loss_fn import default_loss_fn as default_loss_fn  # re-exported
from pipelinerl_jax.train.loss_fn import rl_loss, wrap_loss_fn
from pipelinerl_jax.train.optimizer import decay_mask as decay_mask  # re-exported
from pipelinerl_jax.train.optimizer import learning_rate_schedule, make_optimizer


class NonFiniteLossError(RuntimeError):
    """Too many consecutive train steps with a non-finite loss or gradient."""


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # [] int32 train_step calls so far (applied or skipped)
    version: jax.Array  # [] int32 applied updates: the policy version of `params`
    params: Any  # nnx.State in the model's param dtype
    opt_state: Any  # optax state; moments f32
    ref_params: Any  # frozen reference params for the KL term, or None
    skipped: jax.Array  # [] int32 skipped (non-finite) steps in total
    consecutive_skips: jax.Array  # [] int32 skipped steps in a row, 0 after an applied one


def trainer_mesh(devices=None, *, tp: int = 1) -> Mesh:
    """A ("fsdp", "tp") mesh over `devices` (default: this process's), tp consecutive devices per
    group."""
    devices = list(jax.local_devices() if devices is None else devices)
    if tp < 1 or len(devices) % tp:
        raise ConfigError(f"trainer tp={tp} must divide the {len(devices)} trainer devices")
    # Devices passed explicitly: a tp group is always consecutive devices, on any topology.
    return sharding.make_mesh((len(devices) // tp, tp), (sharding.FSDP, sharding.TP), devices)


def _f32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def _micro_split(x, m: int, mesh: Mesh, batch_axis: str | None):
    """[R, ...] -> [A, R/A, ...] with micro-batch k = rows k, k+A, ...: stays shard-local."""
    x = x.reshape((x.shape[0] // m, m) + x.shape[1:]).swapaxes(0, 1)
    spec = P(None, batch_axis) if batch_axis in mesh.shape else P()
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _accumulated(acc, grads, layers: dict):
    """acc + grads (params' structure; grads in f32), except under "layers", whose leaves are
    taken from `layers` (a dict holding the sums already)."""

    def dict_keys(path):
        return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))

    sums = {dict_keys(path): x for path, x in jax.tree_util.tree_leaves_with_path(layers)}

    def add(path, a, g):
        keys = dict_keys(path)
        return sums[keys[1:]] if keys[0] == "layers" else a + g.astype(jnp.float32)

    return jax.tree_util.tree_map_with_path(add, acc, grads)


def _learning_rate(opt_state) -> jax.Array | None:
    """The learning rate a custom optimizer reports in its state (optax.inject_hyperparams)."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
    scalars = [v for _, v in found if jnp.ndim(v) == 0]
    return jnp.asarray(scalars[0], jnp.float32) if scalars else None


def _train_step(
    state: TrainState,
    batch: TrainBatch,
    frozen,
    *,
    graphdef,
    cfg: TrainerConfig,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    loss_fn: LossFn | None,
    batch_axis: str | None,
    default_tx: bool,
):
    lc = cfg.loss
    kl_coef = linear_schedule(lc.kl_coef, lc.kl_coef_end, lc.kl_schedule_steps, state.step)
    ent_coef = linear_schedule(
        lc.entropy_coef, lc.entropy_coef_end, lc.entropy_schedule_steps, state.step
    )
    if loss_fn is None:
        objective = functools.partial(
            rl_loss,
            graphdef=graphdef,
            loss_cfg=lc,
            kl_coef=kl_coef,
            entropy_coef=ent_coef,
            attention_block=cfg.attention_block,
            version=state.version,
        )
    else:
        objective = functools.partial(wrap_loss_fn, loss_fn)
    ref = state.ref_params if lc.uses_reference else None
    if frozen is not None:
        # LoRA: state.params are the adapters, the only thing differentiated; the frozen base
        # joins them inside the loss. The KL reference is the base itself (no adapters), so it
        # costs no copy.
        full_objective = objective
        objective = lambda adapters, ref, batch: full_objective(  # noqa: E731
            shared_base.join(adapters, frozen), ref, batch
        )
        ref = shared_base.join({"layers": {}}, frozen) if lc.uses_reference else None
    grad_fn = jax.grad(objective, has_aux=True)
    m = cfg.micro_batches
    if m == 1:
        grads, stats = grad_fn(state.params, ref, batch)
        grads = _f32(grads)
    else:
        micro = {k: _micro_split(getattr(batch, k), m, mesh, batch_axis) for k in TOKEN_FIELDS}
        in_place = cfg.accumulate_in_place and loss_fn is None and frozen is None

        def add_micro_grads(acc_grads, xs):
            if in_place:
                # The layers' gradients come back as the accumulator's own cotangent, added
                # into it in place by the backward; only the small rest (embedding, norms,
                # head) is added here. The params' layer entries get none (zeros, unused).
                layer_fn = lambda p, acc_layers, ref, b: objective(  # noqa: E731
                    p, ref, b, layer_grads_into=acc_layers
                )
                acc_layers = decoder.arrays(acc_grads)["layers"]
                (g, acc_layers), s = jax.grad(layer_fn, argnums=(0, 1), has_aux=True)(
                    state.params, acc_layers, ref, batch.replace(**xs)
                )
                return _accumulated(acc_grads, g, acc_layers), s
            g, s = grad_fn(state.params, ref, batch.replace(**xs))
            return jax.tree.map(jnp.add, acc_grads, _f32(g)), s

        def accumulate(acc, xs):
            grads, s = add_micro_grads(acc[0], xs)
            return grads, losses.accumulate(acc[1], s)

        # A micro-batch with no scored token adds nothing to the loss, gradient or stats: the
        # cond skips its forward and backward, so rows the packing left empty cost nothing.
        def body(acc, xs):
            return jax.lax.cond(
                jnp.any(xs["loss_mask"] > 0), accumulate, lambda a, _: a, acc, xs
            ), None

        first = batch.replace(**jax.tree.map(lambda x: x[0], micro))
        _, stats_shape = jax.eval_shape(grad_fn, state.params, ref, first)
        zeros = (
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params),
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape),
        )
        (grads, stats), _ = jax.lax.scan(body, zeros, micro)

    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(stats["loss"]) & jnp.isfinite(grad_norm)

    def apply(params, opt_state):
        g = grads
        if cfg.grad_clip_norm > 0:
            scale = jnp.minimum(1.0, cfg.grad_clip_norm / grad_norm)
            g = jax.tree.map(lambda x: x * scale, grads)
        updates, opt_state = tx.update(g, opt_state, _f32(params))
        params = jax.tree.map(
            lambda p, u: (p.astype(jnp.float32) + u).astype(p.dtype), params, updates
        )
        return params, opt_state

    # A cond, not per-leaf selects: a skipped step costs nothing and compiles to fewer kernels.
    new_params, new_opt = jax.lax.cond(
        ok, apply, lambda p, o: (p, o), state.params, state.opt_state
    )
    skipped = jnp.where(ok, 0, 1).astype(jnp.int32)
    new_state = state.replace(
        step=state.step + 1,
        version=state.version + 1 - skipped,
        params=new_params,
        opt_state=new_opt,
        skipped=state.skipped + skipped,
        consecutive_skips=jnp.where(ok, 0, state.consecutive_skips + 1).astype(jnp.int32),
    )
    metrics = losses.finalize(stats)
    metrics.update(lag.lag_metrics(batch.versions, batch.loss_mask, state.version))
    metrics.update(
        losses.advantage_metrics(batch.sequence_advantages, batch.rewards, batch.sequence_mask)
    )
    # The built-in schedule is a function of applied updates; a custom optimizer's rate is
    # reported only if its state carries one (absent otherwise, rather than a wrong value).
    lr = learning_rate_schedule(cfg)(state.version) if default_tx else _learning_rate(new_opt)
    if lr is not None:
        metrics["lr"] = lr
    metrics.update(
        grad_norm=grad_norm,
        kl_coef=jnp.asarray(kl_coef, jnp.float32),
        entropy_coef=jnp.asarray(ent_coef, jnp.float32),
        skipped=skipped,
        skipped_total=new_state.skipped,
        consecutive_skips=new_state.consecutive_skips,
        version=state.version,
    )
    return new_state, metrics


class Trainer:
    """Owns the mesh layout, the optimizer and the compiled step for one model and config.

    loss_fn: `loss_fn(params, batch) -> (loss, aux)` (see LossFn) replacing the built-in RL
    loss (rl_loss, with its KL and entropy schedules and reference params); optimizer: an optax
    GradientTransformation replacing `make_optimizer(cfg)` (it sees f32 params and gradients,
    so its state is f32; the step still clips by cfg.grad_clip_norm first: set it to 0 to leave
    clipping to the optimizer; the "lr" metric is reported if its state has a scalar
    "learning_rate", as with optax.inject_hyperparams); rules: logical-axis rules replacing
    sharding.RULES for params, optimizer state and batch rows (the "batch" rule's mesh axis).
    The mesh may only use axes the rules map to (ConfigError otherwise).
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        graphdef,
        abstract_params,
        mesh: Mesh,
        *,
        loss_fn: LossFn | None = None,
        optimizer: optax.GradientTransformation | None = None,
        rules: sharding.Rules | None = None,
    ):
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"Trainer(loss_fn=...) must be callable, got {loss_fn!r}")
        if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(
                f"Trainer(optimizer=...) must be an optax GradientTransformation, got {optimizer!r}"
            )
        self.rules = tuple(sharding.RULES if rules is None else rules)
        sharding.check_mesh(mesh, self.rules)
        self.cfg, self.graphdef, self.mesh = cfg, graphdef, mesh
        # LoRA (model.lora): the state's params are the adapters; the base stays frozen beside
        # the state (`self.frozen`), never donated, so a sampler on the same device can read it.
        self.lora = decoder.config_of(graphdef).lora
        self.frozen = None
        self.base_fingerprint = None  # lora.fingerprint of the frozen base (init_state)
        self.frozen_shardings = None
        if self.lora is not None:
            abstract_params, abstract_frozen = lora.split(abstract_params)
            self.frozen_shardings = sharding.param_shardings(abstract_frozen, mesh, self.rules)
        self.loss_fn = loss_fn  # None: the built-in rl_loss
        self.tx = make_optimizer(cfg) if optimizer is None else optimizer
        self._default_tx = optimizer is None
        self.batch_axis = sharding.batch_axis(self.rules)
        self.param_shardings = sharding.param_shardings(abstract_params, mesh, self.rules)
        repl = sharding.replicated(mesh)
        opt_shapes = jax.eval_shape(lambda p: self.tx.init(_f32(p)), abstract_params)
        self.opt_shardings = optax.tree_map_params(
            self.tx,
            lambda _, s: s,
            opt_shapes,
            self.param_shardings,
            transform_non_params=lambda _: repl,
        )
        self._batch_shardings = self.batch_shardings()
        ref_sh = self.param_shardings if cfg.loss.uses_reference and not self.lora else None
        self.state_shardings = TrainState(
            step=repl,
            version=repl,
            params=self.param_shardings,
            opt_state=self.opt_shardings,
            ref_params=ref_sh,
            skipped=repl,
            consecutive_skips=repl,
        )
        self._jit_step(self.frozen_shardings)

    def _jit_step(self, frozen_shardings) -> None:
        cfg, repl = self.cfg, sharding.replicated(self.mesh)
        self._step = jax.jit(
            functools.partial(
                _train_step,
                graphdef=self.graphdef,
                cfg=cfg,
                tx=self.tx,
                mesh=self.mesh,
                loss_fn=self.loss_fn,
                batch_axis=self.batch_axis,
                default_tx=self._default_tx,
            ),
            in_shardings=(self.state_shardings, self._batch_shardings, frozen_shardings),
            out_shardings=(self.state_shardings, repl),
            donate_argnums=0,
        )

    def _row_devices(self) -> int:
        return self.mesh.shape.get(self.batch_axis, 1)

    def batch_shardings(self) -> TrainBatch:
        """Rows over the batch axis ("fsdp"); the per-sequence fields replicated."""
        rows = P(self.batch_axis) if self._row_devices() > 1 else P()
        rows_sh = NamedSharding(self.mesh, rows)
        repl = sharding.replicated(self.mesh)
        return TrainBatch(
            **{k: rows_sh for k in TOKEN_FIELDS}, **{k: repl for k in SEQUENCE_FIELDS}
        )

    def check_rows(self, num_rows: int) -> None:
        """Rows must split evenly into micro-batches and over the batch axis's devices."""
        devices = self._row_devices()
        if num_rows % (self.cfg.micro_batches * devices):
            raise ConfigError(
                f"batch.num_rows={num_rows} must be a multiple of trainer.micro_batches="
                f"{self.cfg.micro_batches} x {self.batch_axis or 'batch'} devices={devices}"
            )

    def put_batch(self, batch: TrainBatch) -> TrainBatch:
        """Host (numpy) batch -> device arrays laid out for the step."""
        self.check_rows(batch.tokens.shape[0])
        return jax.device_put(batch, self._batch_shardings)

    def init_state(self, params, ref_params=None) -> TrainState:
        """Sharded copies of the params, f32 moments; the reference defaults to the params.

        With LoRA, `params` is the whole model: its adapters are copied into the state, and its
        base is placed (not copied where it already is) as `self.frozen`, which every step reads
        and none donates. The KL reference is then the base, and `ref_params` must be None."""
        # Copies: the step donates the state, and callers (the sampler) keep using their params.
        copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings)
        if self.lora is not None:
            if ref_params is not None:
                raise ConfigError(
                    "Trainer.init_state: with model.lora the KL reference is the frozen base; "
                    "pass no ref_params"
                )
            params, frozen = lora.split(params)
            # What checkpoints record of the base; hashed now, while each process holds all of
            # it (after placement a multi-process mesh holds only shards here).
            self.base_fingerprint = lora.fingerprint(frozen)
            self.frozen = jax.device_put(frozen, self.frozen_shardings)
        params = copy(params)
        opt_state = jax.jit(lambda p: self.tx.init(_f32(p)), out_shardings=self.opt_shardings)(
            params
        )
        ref = None
        if self.cfg.loss.uses_reference and self.lora is None:
            ref = copy(params if ref_params is None else ref_params)
        # Distinct buffers: the step donates every leaf of the state.
        zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), sharding.replicated(self.mesh))
        return TrainState(
            step=zero(),
            version=zero(),
            params=params,
            opt_state=opt_state,
            ref_params=ref,
            skipped=zero(),
            consecutive_skips=zero(),
        )

    def train_step(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict]:
        """One optimizer step; `state` is donated (do not reuse it). Metrics stay on device."""
        if isinstance(batch.tokens, np.ndarray):
            batch = self.put_batch(batch)
        self.check_rows(batch.tokens.shape[0])
        if self.lora is not None and self.frozen is None:
            raise ConfigError("Trainer.train_step with model.lora: call init_state first")
        return self._step(state, batch, self.frozen)

    def lower(self, state: TrainState, batch: TrainBatch):
        """The compiled step's `jax.stages.Lowered` for these inputs (arrays or
        ShapeDtypeStructs): `.compile().memory_analysis()` is XLA's buffer assignment of the
        step, `.as_text()` its program. Nothing runs and nothing is donated."""
        if isinstance(batch.tokens, np.ndarray):
            batch = self.put_batch(batch)
        return self._step.lower(state, batch, self.frozen)

    def full_params(self, params):
        """The whole model's params for the state's `params`: the adapters joined to the frozen
        base under LoRA, else `params` itself (what an evaluation or an export reads). A shared
        base (`read_base`) is copied back to stored params for it."""
        if self.lora is None:
            return params
        return lora.merge(params, self.stored_base())

    def stored_base(self) -> dict:
        """LoRA: the frozen base as stored params (copied back when it is a shared base)."""
        return shared_base.stored(self.frozen)

    def read_base(self, base: shared_base.SharedBase) -> None:
        """LoRA on one shared device: read the frozen base from a sampler's converted copy
        (models/shared_base.py) and drop this trainer's own, so the run holds one copy of it.
        The base must be the one init_state was given (the sampler's view of it)."""
        if self.lora is None or self.frozen is None:
            raise ConfigError("Trainer.read_base: needs model.lora and init_state first")
        if isinstance(self.frozen, shared_base.SharedBase):
            raise ConfigError("Trainer.read_base: the trainer already reads a shared base")
        if self.mesh.devices.size != 1:
            raise ConfigError(
                f"Trainer.read_base: a trainer over {self.mesh.devices.size} devices keeps its "
                "own sharded base (sharing is for one device holding sampler and trainer)"
            )
        (device,) = self.mesh.devices.flat
        held = {d for x in jax.tree.leaves(base) for d in x.devices()}
        if held != {device}:
            raise ConfigError(
                f"Trainer.read_base: the base is on {sorted(map(str, held))}, the trainer on "
                f"{device}; sharing needs one device"
            )
        self.frozen = base
        self._jit_step(jax.tree.map(lambda _: sharding.replicated(self.mesh), base))

    def check(self, metrics: dict) -> None:
        """check_skips with this trainer's max_consecutive_skips (call on fetched metrics)."""
        check_skips(metrics, self.cfg.max_consecutive_skips)


def check_skips(metrics: dict, max_consecutive_skips: int) -> None:
    """Host-side: raises NonFiniteLossError after too many non-finite steps in a row."""
    run = int(metrics["consecutive_skips"])
    if run >= max_consecutive_skips:
        raise NonFiniteLossError(
            f"{run} consecutive train steps had a non-finite loss or gradient (at policy version "
            f"{int(metrics['version'])}, loss {float(metrics['loss'])}); stopping. Check rewards "
            "and sampler logprobs for NaN/Inf, lower trainer.learning_rate, or raise "
            "trainer.max_consecutive_skips"
        )
