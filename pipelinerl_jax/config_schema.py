"""Every field a run config can set: its path, type, default and meaning (launch.py --help).

The dataclasses that `config_dict.from_config_dict` builds are the one source of truth. A
field's type is its annotation, its default the dataclass default (config_dict.py's TOP_DEFAULTS
and GENERATION_DEFAULTS for RunConfig's own fields, which the dataclass leaves required), and its
meaning the `#` comment beside it in the source, continued on the comment lines below that are
indented past the field, or the comment block just above it. The comments are read with
`ast` + `tokenize`, so there is no second copy of them to fall out of date.

Dict fields take keys of their own, each a field here too: `model.init` (ModelConfig's
architecture), `model.lora` (LoraConfig), `data.task_options` (the built-in tasks' fields),
`reward.table_options` (RewardTable's coefficients) and `env.options` (the shipped
environments' keyword arguments).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import tokenize
import typing
from typing import Any

from pipelinerl_jax.data.tasks import TASKS
from pipelinerl_jax.envs.registry import ENVIRONMENTS
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.models.config import ModelConfig
from pipelinerl_jax.models.lora import LoraConfig
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.pipeline import config_dict
from pipelinerl_jax.rewards.tables import REWARD_TABLES, RewardTable

MISSING = dataclasses.MISSING
# Fields whose default from_config_dict computes from other fields: (default, how).
_DERIVED_DEFAULTS = {
    "trainer.total_steps": (MISSING, "steps"),
    "loss.temperature": (MISSING, "generation.temperature (must be equal)"),
    "batch.seq_len": (0, "0 = generation.max_prompt_tokens + max_new_tokens"),
    "batch.num_rows": (0, "0 = enough rows for any batch"),
}
# Fields that hold a JSON list / a JSON object in the ConfigDict (tuples in the dataclasses).
LIST_FIELDS = ("data.datasets", "data.few_shot", "eval.datasets")
DICT_FIELDS = (
    "model.init",
    "model.lora",
    "data.task_options",
    "reward.table_options",
    "env.options",
)


@dataclasses.dataclass(frozen=True)
class Field:
    """One settable field of the ConfigDict."""

    path: str  # dotted, without "config.": "trainer.learning_rate"
    type: Any  # the dataclass annotation
    default: Any  # MISSING: required, or derived (see `derived`)
    doc: str  # the field's comment
    kind: str = "value"  # "value" | "list" | "dict"
    derived: str = ""  # how the default is computed when the file leaves it out
    section_doc: str = ""  # first line of the section dataclass's docstring


def field_docs(cls) -> dict[str, str]:
    """Field name -> its `#` comment, for a dataclass and the dataclasses it inherits from."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            for name, text in _own_docs(base).items():
                if text or name not in docs:  # a subclass redefining a default keeps the doc
                    docs[name] = text
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


@functools.cache
def _own_docs(cls) -> dict[str, str]:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source (e.g. a frozen install): meanings are blank
        return {}
    lines = source.splitlines()
    comments = {}  # row -> (column, text, alone on its line, continues the comment above)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            alone = not lines[row - 1][:col].strip()
            # "#   more": a comment line indented inside the `#` continues the one above it (the
            # formatter aligns every comment line with the code, so indentation is in the text).
            continued = alone and tok.string.startswith("#  ")
            comments[row] = (col, tok.string.lstrip("#").strip(), alone, continued)
    docs = {}
    for stmt in ast.parse(source).body[0].body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        col, above, beside = stmt.col_offset, [], []
        row = stmt.lineno - 1
        # A continued comment above belongs to the previous field and ends this one's block.
        while (
            row in comments
            and comments[row][2]
            and not comments[row][3]
            and comments[row][0] == col
        ):
            above.insert(0, comments[row][1])
            row -= 1
        for row in range(stmt.lineno, stmt.end_lineno + 1):
            if row in comments and not comments[row][2]:
                beside.append(comments[row][1])
        row = stmt.end_lineno + 1
        while beside and row in comments and comments[row][3]:
            beside.append(comments[row][1])
            row += 1
        docs[stmt.target.id] = " ".join(t for t in above + beside if t)
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _has_field(owner: Any, name: str) -> bool:
    """Whether a task class or a reward table has a dataclass field `name` (not a ClassVar such
    as a task's `name`, nor a property such as reasoning_gym's `num_problems`)."""
    return any(f.name == name for f in dataclasses.fields(owner))


def _owner_default(owner: Any, name: str) -> Any:
    """A reward table's value of field `name` (tables are instances), or a task's default."""
    if not isinstance(owner, type):
        return getattr(owner, name)
    return _default(next(f for f in dataclasses.fields(owner) if f.name == name))


def _common_default(owners: dict[str, Any], name: str, what: str) -> tuple[Any, str]:
    """(default, "") when every owner defining `name` agrees, else (MISSING, "per task: a 1,
    b 2")."""
    values = {o: _owner_default(obj, name) for o, obj in owners.items() if _has_field(obj, name)}
    if len({repr(v) for v in values.values()}) == 1:
        return next(iter(values.values())), ""
    return MISSING, f"per {what}: " + ", ".join(f"{o} {v!r}" for o, v in values.items())


def _section_doc(section: str, cls) -> str:
    """The first paragraph of the section dataclass's own docstring (not dataclass's repr)."""
    if section == "generation":
        return "How completions are sampled (the run's own fields)."
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(cls.__name__ + "("):  # dataclass's generated signature: no docstring
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def _section_fields(section: str, cls) -> list[Field]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    first = _section_doc(section, cls)
    skip = set(config_dict.DERIVED.get(section, {}))
    if section == "generation":
        names = list(config_dict.GENERATION_DEFAULTS)
    else:
        names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for name in names:
        path = f"{section}.{name}"
        default = (
            config_dict.GENERATION_DEFAULTS[name]
            if section == "generation"
            else _default(by_name[name])
        )
        derived = ""
        if path in _DERIVED_DEFAULTS:
            default, derived = _DERIVED_DEFAULTS[path]
        kind = "list" if path in LIST_FIELDS else "dict" if path in DICT_FIELDS else "value"
        if kind == "dict":
            default = {}
        elif kind == "list":
            default = []
        out.append(Field(path, hints[name], default, docs[name], kind, derived, first))
        if kind == "dict":
            out.extend(_dict_keys(path))
    return out


def _dict_keys(path: str) -> list[Field]:
    """The keys of model.init, model.lora, data.task_options, reward.table_options and
    env.options, as fields."""

    if path in ("model.init", "model.lora"):
        cls = ModelConfig if path == "model.init" else LoraConfig
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        return [
            Field(f"{path}.{f.name}", hints[f.name], _default(f), docs[f.name])
            for f in dataclasses.fields(cls)
            if path == "model.lora" or f.name in config_lib.INIT_FIELDS
        ]
    if path == "env.options":
        return _env_options(path)
    owners = TASKS if path == "data.task_options" else REWARD_TABLES
    what = "task" if path == "data.task_options" else "table"
    classes = list(TASKS.values()) if path == "data.task_options" else [RewardTable]
    out, seen = [], set()
    for cls in classes:
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name in seen or (what == "table" and f.name == "name"):  # the table's own
                continue
            seen.add(f.name)
            default, per_owner = _common_default(owners, f.name, what)
            which = [o for o, obj in owners.items() if _has_field(obj, f.name)]
            doc = docs[f.name]
            if path == "data.task_options" and len(which) < len(owners):
                doc += f" (tasks: {', '.join(which)})"
            out.append(Field(f"{path}.{f.name}", hints[f.name], default, doc, derived=per_owner))
    return out


def _env_options(path: str) -> list[Field]:
    """The shipped environments' constructor keywords: env.options' keys."""
    options: dict[str, dict[str, tuple[Any, Any]]] = {}  # option -> env -> (default, type)
    for env, cls in ENVIRONMENTS.items():
        hints = typing.get_type_hints(cls.__init__)
        for p in inspect.signature(cls.__init__).parameters.values():
            if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
                default = MISSING if p.default is p.empty else p.default
                options.setdefault(p.name, {})[env] = (default, hints.get(p.name, Any))
    out = []
    for name, per_env in options.items():
        defaults = {env: default for env, (default, _) in per_env.items()}
        same = len({repr(v) for v in defaults.values()}) == 1
        derived = (
            ""
            if same
            else "per environment: " + ", ".join(f"{env} {v!r}" for env, v in defaults.items())
        )
        doc = f"an option of the {', '.join(per_env)} environment" + "s" * (len(per_env) > 1)
        typ = next(iter(per_env.values()))[1]
        default = next(iter(defaults.values())) if same else MISSING
        out.append(Field(f"{path}.{name}", typ, default, doc, derived=derived))
    return out


@functools.cache
def fields() -> tuple[Field, ...]:
    """Every settable field: the top level, then each section in config.SECTIONS order."""
    hints, docs = typing.get_type_hints(config_lib.RunConfig), field_docs(config_lib.RunConfig)
    by_name = {f.name: f for f in dataclasses.fields(config_lib.RunConfig)}
    out = []
    for name in config_dict.TOP_FIELDS:
        default = config_dict.TOP_DEFAULTS.get(name, _default(by_name[name]))
        out.append(Field(name, hints[name], MISSING if default is None else default, docs[name]))
    for section, cls in config_dict.SECTIONS.items():
        out.extend(_section_fields(section, cls))
    return tuple(out)


@functools.cache
def by_path() -> dict[str, Field]:
    return {f.path: f for f in fields()}


def find(path: str) -> Field:
    """The field at `path` ("trainer.learning_rate"); a one-line ConfigError with the closest
    valid path otherwise."""
    table = by_path()
    if path in table:
        return table[path]
    if path in config_dict.SECTIONS:
        example = next(f.path for f in fields() if f.path.startswith(path + "."))
        raise ConfigError(
            f"--config.{path} is a section; set its fields, e.g. --config.{example}=..."
        )
    head, _, leaf = path.rpartition(".")
    if leaf in config_dict.DERIVED.get(head, {}):
        raise ConfigError(
            f"--config.{path} is set from {config_dict.DERIVED[head][leaf]}; leave it out"
        )
    if head in table and table[head].kind != "dict":
        raise ConfigError(f"--config.{path}: {head} is not a dict; set --config.{head}=VALUE")
    raise ConfigError(
        f"--config.{path}: no such field{suggest(path)} (launch.py --help lists every field)"
    )


def suggest(path: str) -> str:
    """ "; did you mean --config.X?" for a mistyped path, or ""."""
    paths = list(by_path())
    leaf = path.rpartition(".")[2]
    # The right name in the wrong place (`--config.learning_rate`), else the closest spelling.
    found = [p for p in paths if p.rpartition(".")[2] == leaf]
    found = found or difflib.get_close_matches(path, paths, n=1, cutoff=0.6)
    if not found:
        leaves = {}
        for p in paths:
            leaves.setdefault(p.rpartition(".")[2], p)
        found = [leaves[c] for c in difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)]
    if not found:
        return ""
    return "; did you mean " + " or ".join(f"--config.{p}" for p in found[:3]) + "?"
