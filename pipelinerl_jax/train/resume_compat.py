"""Whether a run may resume from a checkpoint saved under another config, and what changed.

    for change in check_compatible(extra["config"], config_lib.as_dict(cfg)):  # or ConfigError
        echo(f"resume: config change allowed: {change}")

A resumed run continues the saved one: its train state, admitted and pending groups and data
position. Most fields may change between the two (learning rate, steps, logging, sampler
sizes): those are returned as "field: old -> new" lines for the log. A change that would make
the restored state mean something else (the model, group or batch size, mode, seed, the data
and its order, the optimizer state's structure) is refused with a ConfigError naming the field
and what it would break. Both configs are `pipeline.config.as_dict` dicts, compared by their
dotted field names, so this module needs nothing of the pipeline layer itself.
"""

from __future__ import annotations

import json
from typing import Any

from pipelinerl_jax.errors import ConfigError


def _is_items(value: Any) -> bool:
    """A dict stored as sorted (name, value) pairs, as config.py keeps model.init."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in value)
    )


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if _is_items(d):
        d = dict(d)
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def _normalise(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


# Fields whose change would break a resumed run, and why.
_REFUSED = {
    "group_size": "change the group layout of the admitted and pending groups",
    "batch_size": "change which groups each step trains",
    "mode": "change the admission and training order",
    "seed": "change the data order",
    "data.task": "change the prompts",
    "data.task_options": "change the prompts",
    "data.datasets": "change the prompts",
    "data.shuffle_seed": "change the data order",
}


# Fields that may grow but not shrink: the groups carried over were made under the old value.
_NO_SMALLER = {
    "max_lag": "train carried-over groups up to the old bound's lag, above the new bound",
    "max_new_tokens": "carry over completions longer than the new limit",
    "max_prompt_tokens": "carry over prompts longer than the new limit",
}


def _refusal(field: str, old: Any, new: Any, saved: dict, new_cfg: dict) -> str | None:
    if field == "model" or field.startswith("model."):
        return "change the model the checkpoint holds"
    for name, why in _REFUSED.items():
        if field == name or field.startswith(name + "."):
            return why
    if field in _NO_SMALLER and isinstance(old, int) and isinstance(new, int) and new < old:
        return _NO_SMALLER[field]
    if field == "conventional_steps" and new_cfg.get("mode") == "conventional":
        return "change the conventional-mode round structure"
    if field == "trainer.grad_clip_norm" and ((old or 0) > 0) != ((new or 0) > 0):
        return "change the optimizer state's structure (clipping on/off)"
    if field in ("trainer.loss.kl_coef", "trainer.loss.kl_coef_end"):

        def uses_ref(c):
            loss = c.get("trainer", {}).get("loss", {})
            return (loss.get("kl_coef") or 0) > 0 or (loss.get("kl_coef_end") or 0) > 0

        if uses_ref(saved) != uses_ref(new_cfg):
            return "add or drop the KL reference params in the train state"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _diffs(saved_config: dict, new_config: dict):
    """(field, old, new, why it is refused or None) for each field that differs."""
    saved, new = _normalise(saved_config), _normalise(new_config)
    flat_old, flat_new = _flatten(saved), _flatten(new)
    missing = object()
    for field in sorted(set(flat_old) | set(flat_new)):
        old, cur = flat_old.get(field, missing), flat_new.get(field, missing)
        if old == cur:
            continue
        old_s = "(unset)" if old is missing else _short(old)
        new_s = "(unset)" if cur is missing else _short(cur)
        why = _refusal(
            field, None if old is missing else old, None if cur is missing else cur, saved, new
        )
        yield field, old_s, new_s, why


def check_compatible(saved_config: dict, new_config: dict) -> list[str]:
    """Compares a run's saved config dict with the new one (both `config.as_dict` form).

    Returns the allowed changes as "field: old -> new" lines, for the log (learning rate,
    steps, logging, sampler sizes, ...). Raises ConfigError naming the first change that would
    break the resumed run (model, group/batch size, mode, data order).
    """
    changes = []
    for field, old_s, new_s, why in _diffs(saved_config, new_config):
        if why:
            raise ConfigError(
                f"config.{field} changed ({old_s} -> {new_s}) since the checkpoint: "
                f"resuming would {why}; keep the old value or start a new --workdir"
            )
        changes.append(f"{field}: {old_s} -> {new_s}")
    return changes


def another_run(saved_config: dict, new_config: dict) -> str | None:
    """ "config.F: old -> new" for the first field by which the saved config is another run's
    (a change check_compatible refuses), or None."""
    for field, old_s, new_s, why in _diffs(saved_config, new_config):
        if why:
            return f"config.{field}: {old_s} -> {new_s}"
    return None
