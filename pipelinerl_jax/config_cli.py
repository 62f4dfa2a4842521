"""launch.py's config flags: `--config=FILE` and `--config.<field>=<value>` overrides.

ml_collections' config_flags only overrides fields the file already defines and takes no lists,
so launch.py pulls the overrides out of argv itself (`split_argv`), loads the file
(`load_file`: a Python file whose get_config() returns a ConfigDict) and applies them
(`apply_overrides`). Every path is checked against config_schema (the dataclasses), so a field
the file leaves out can still be set, and a typo is a one-line ConfigError that names the
closest field. A value is JSON when it parses as JSON (numbers, true/false, null, lists,
objects), else the text itself, then converted to the field's type:

    --config.max_lag=3  --config.data.task=word_problems  --config.data.system_prompt=null
    --config.data.datasets='[{"path": "train.jsonl", "format": "gsm8k"}]'
    --config.reward.table_options='{"format_weight": 0.3}'  --config.model.init.num_layers=4
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import textwrap
import types
import typing

import ml_collections

from pipelinerl_jax import cli, config_schema
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import config_dict

PREFIX = "--config."


def split_argv(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(argv without the overrides, [(path, text), ...] in order).

    `--config.x=v` and `--config.x v` are both accepted, like absl's own flags, and a bool
    field alone (`--config.model.remat`) means true."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            rest.extend(argv[i - 1 :])
            break
        if not arg.startswith(PREFIX):
            rest.append(arg)
            continue
        path, eq, text = arg[len(PREFIX) :].partition("=")
        if not eq:
            field = config_schema.find(path)
            if field.type is bool:
                text = "true"
            elif i < len(argv) and not argv[i].startswith("--"):
                text, i = argv[i], i + 1
            else:
                raise ConfigError(f"--config.{path} needs a value: --config.{path}=VALUE")
        overrides.append((path, text))
    return rest, overrides


def load_file(path: str) -> ml_collections.ConfigDict:
    """get_config() of the Python file `path`; every failure is a one-line ConfigError."""
    if not os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        files = (
            sorted(f for f in os.listdir(folder) if f.endswith(".py") and f[0] != "_")
            if os.path.isdir(folder)
            else []
        )
        close = difflib.get_close_matches(os.path.basename(path), files, n=1)
        hint = (
            f"; did you mean {os.path.join(folder, close[0])}?"
            if close
            else f"; {folder} has {', '.join(files)}"
            if files
            else ""
        )
        raise ConfigError(f"--config={path}: no such file{hint}")
    name = "_launch_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"--config={path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: any error in it is theirs to fix, in one line
        raise ConfigError(f"--config={path}: loading it failed: {_one_line(e)}") from None
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(
            f"--config={path} defines no get_config() (it must return a ml_collections.ConfigDict)"
        )
    try:
        cfg = get_config()
    except Exception as e:
        raise ConfigError(f"--config={path}: get_config() raised {_one_line(e)}") from None
    if isinstance(cfg, dict):
        cfg = ml_collections.ConfigDict(cfg)
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(
            f"--config={path}: get_config() returned {type(cfg).__name__}, not a "
            "ml_collections.ConfigDict"
        )
    return cfg


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def apply_overrides(cfg: ml_collections.ConfigDict, overrides) -> None:
    """Sets each (path, text) on cfg, in order (a later one wins)."""
    with cfg.unlocked():  # a file may lock its ConfigDict; overrides may still add fields
        for path, text in overrides:
            set_path(cfg, path, parse_value(config_schema.find(path), text))


def load_run_config(path: str, overrides=()):
    """The RunConfig launch.py runs: the file's get_config() with the parsed `overrides`
    (split_argv's pairs) applied, converted and checked; every failure a one-line
    ConfigError."""
    cfg = load_file(path)
    apply_overrides(cfg, overrides)
    return config_dict.from_config_dict(cfg)


def set_path(cfg: ml_collections.ConfigDict, path: str, value) -> None:
    """cfg.<path> = value for a dotted path, making the sections on the way that cfg lacks
    (cfg must be unlocked to add fields). The path is not checked here: from_config_dict
    names an unknown one."""
    *parents, leaf = path.split(".")
    node = cfg
    for part in parents:
        child = node.get(part, None)
        if not isinstance(child, (dict, ml_collections.ConfigDict)):
            child = _set(node, part, ml_collections.ConfigDict())
        node = child
    _set(node, leaf, value)


def _set(node, key: str, value):
    """node[key] = value; the value is already of the dataclass's type, so where the file's
    value has another one (an int in a float field) the dataclass wins over ConfigDict's check."""
    try:
        node[key] = value
    except TypeError:
        del node[key]
        node[key] = value
    return node[key]


def parse_value(field: config_schema.Field, text: str):
    """`text` as JSON when it parses, else as is, converted to the field's type."""
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    where = f"--config.{field.path}={text}"
    if field.kind == "list":
        if not isinstance(value, list):
            raise ConfigError(
                f"{where}: expected a JSON list, e.g. "
                f"--config.{field.path}='{_EXAMPLES.get(field.path, '[]')}'"
            )
        return value
    if field.kind == "dict":
        if not isinstance(value, dict):
            raise ConfigError(
                f"{where}: expected a JSON object, e.g. "
                f"--config.{field.path}='{_EXAMPLES.get(field.path, '{}')}'"
            )
        return value
    return _convert(value, text, field.type, where)


_EXAMPLES = {
    "data.datasets": '[{"path": "train.jsonl", "format": "gsm8k"}]',
    "eval.datasets": '[{"path": "test.jsonl", "format": "gsm8k"}]',
    "data.few_shot": '[{"question": "1+2?", "answer": "3"}]',
    "reward.table_options": '{"format_weight": 0.3}',
    "data.task_options": '{"min_digits": 2, "max_digits": 5}',
    "model.init": '{"model_type": "llama", "vocab_size": 16, ...}',
}


def _convert(value, text: str, typ, where: str):
    """value (parsed JSON, or the raw text) as an instance of the annotation `typ`."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:  # e.g. int | tuple[int, ...]: take the JSON value as it is
            return tuple(value) if isinstance(value, list) else value
        typ = rest[0]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "false", "1", "0", "yes", "no"):
            return str(value).lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true or false")
    if typ is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(value)  # "inf", "nan"
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number") from None
    if typ is str:
        return value if isinstance(value, str) else text
    if typing.get_origin(typ) is tuple or typ is tuple:
        if isinstance(value, (list, dict)):
            return tuple(value) if isinstance(value, list) else value
        raise ConfigError(f"{where}: expected a JSON list")
    return value


def help_text(cfg: ml_collections.ConfigDict, source: str, width: int = 100) -> str:
    """Every config field with the value `source` gives it (or its default) and its meaning."""
    intro = (
        f"config fields. Set any with --config.<field>=<value>; shown: the value in {source}, "
        "with [the built-in default] where it differs. Values are JSON when they parse "
        "(numbers, true/false, null, lists, objects), else text:"
    )
    lines = textwrap.wrap(intro, width) + [
        '    --config.data.datasets=\'[{"path": "train.jsonl", "format": "gsm8k"}]\'',
        "    --config.reward.table_options='{\"format_weight\": 0.3}'  --config.max_lag=4",
    ]
    section = None
    for field in config_schema.fields():
        head = field.path.split(".")[0] if "." in field.path else ""
        if head != section:
            section = head
            title = f"{head}:" if head else "top level:"
            if field.section_doc:
                title += f" {field.section_doc}"
            lines += ["", title]
        lines.append(_field_line(field, cfg))
        if field.doc:
            lines += textwrap.wrap(
                field.doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6
            )
    return "\n".join(lines) + "\n"


def _field_line(field: config_schema.Field, cfg) -> str:
    found, value = _lookup(cfg, field.path)
    builtin = field.default
    head = f"  --config.{field.path}"
    notes = [_type_name(field)]
    if found:
        head += "=" + _show(value)
        if builtin is not config_schema.MISSING and _show(builtin) != _show(value):
            notes.append(f"[built-in {_show(builtin)}]")
    elif builtin is not config_schema.MISSING:
        head += "=" + _show(builtin)
    if not found and field.derived:
        notes.append(f"default: {field.derived}")
    elif not found and builtin is config_schema.MISSING and "." not in field.path:
        notes.append("required")
    return f"{head}  ({'; '.join(notes)})"


def _lookup(cfg, path: str):
    node = cfg
    for part in path.split("."):
        if not hasattr(node, "get") or part not in node:
            return False, None
        node = node[part]
    return True, node


def _show(value, limit: int = 70) -> str:
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(field: config_schema.Field) -> str:
    if field.kind != "value":
        return f"{field.kind}, JSON"
    typ = field.type
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        names = [_type_name_of(a) for a in typing.get_args(typ)]
        return " or ".join(names)
    return _type_name_of(typ)


def _type_name_of(typ) -> str:
    if typ is type(None):
        return "null"
    if typing.get_origin(typ) is tuple or typ is tuple:
        return "list"
    return getattr(typ, "__name__", str(typ))


def check_workdir(path: str | None, *, create: bool) -> None:
    """A one-line ConfigError unless `path` is, or can become, a writable directory.

    create: make it and write a probe file into it (what the run does first); else (dry run)
    leave the disk alone and check that its nearest existing ancestor is a writable directory.
    """
    if path:
        cli.check_dir(path, create=create, where=f"--workdir={path}")
