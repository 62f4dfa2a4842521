"""config_schema: every field of the run's dataclasses is settable and documented, the field
comments are read from the source (beside, continued below, or in a block above), and a
mistyped path gets the closest real one."""

import dataclasses

import pytest

from pipelinerl_jax import config_schema
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import config_dict


@dataclasses.dataclass(frozen=True)
class _Documented:
    plain: int = 1  # beside the field
    continued: str = "x"  # beside, and continued
    #   on the next line
    # A block above the field,
    # two lines long.
    above: float = 0.5
    bare: bool = False
    last: tuple = ()  # after a bare field


@dataclasses.dataclass(frozen=True)
class _Child(_Documented):
    plain: int = 2  # (a subclass that only changes a default keeps the parent's doc)


def test_field_docs_reads_beside_continued_and_above_comments():
    docs = config_schema.field_docs(_Documented)
    assert docs == {
        "plain": "beside the field",
        "continued": "beside, and continued on the next line",
        "above": "A block above the field, two lines long.",
        "bare": "",
        "last": "after a bare field",
    }


def test_field_docs_of_a_subclass_falls_back_to_the_parent():
    docs = config_schema.field_docs(_Child)
    assert docs["plain"] == "(a subclass that only changes a default keeps the parent's doc)"
    assert docs["continued"] == "beside, and continued on the next line"


def test_every_field_has_a_meaning():
    """A new dataclass field needs a `#` comment: --help shows it as the field's meaning."""
    missing = [f.path for f in config_schema.fields() if not f.doc]
    assert missing == []


def test_every_run_config_field_is_settable():
    """Each RunConfig leaf has a path (derived ones excepted), so --config.<path> can set it."""
    paths = set(config_schema.by_path())
    expected = {name for name in config_dict.TOP_FIELDS}
    expected |= {f"generation.{n}" for n in config_dict.GENERATION_DEFAULTS}
    for section, cls in config_dict.SECTIONS.items():
        if section == "generation":
            continue
        derived = set(config_dict.DERIVED.get(section, {}))
        expected |= {
            f"{section}.{f.name}" for f in dataclasses.fields(cls) if f.name not in derived
        }
    assert expected <= paths, sorted(expected - paths)
    # model.init's keys are ModelConfig's architecture fields; dtypes and remat live in model.
    assert "model.init.num_layers" in paths and "model.init.remat" not in paths
    assert {
        "data.task_options.max_digits",
        "data.task_options.difficulty",
        "reward.table_options.format_weight",
    } <= paths


def test_defaults_come_from_the_dataclasses():
    table = config_schema.by_path()
    assert table["trainer.learning_rate"].default == 1e-6
    assert table["reward.timeout_s"].default == 5.0
    assert table["generation.max_new_tokens"].default == 256
    assert table["steps"].default is config_schema.MISSING  # required
    assert table["trainer.total_steps"].derived == "steps"
    assert table["data.task_options.max_digits"].derived.startswith("per task:")
    assert table["data.datasets"].kind == "list" and table["reward.table_options"].kind == "dict"


@pytest.mark.parametrize(
    "path, hint",
    [
        ("max_lagg", "did you mean --config.max_lag?"),
        ("learning_rate", "did you mean --config.trainer.learning_rate?"),
        ("trainer.learning_rat", "did you mean --config.trainer.learning_rate?"),
        ("data.task_options.max_digitz", "did you mean --config.data.task_options.max_digits?"),
    ],
)
def test_find_suggests_the_closest_field(path, hint):
    with pytest.raises(ConfigError, match="no such field") as e:
        config_schema.find(path)
    assert hint in str(e.value) and "\n" not in str(e.value)


def test_find_explains_sections_derived_fields_and_non_dicts():
    with pytest.raises(ConfigError, match="is a section; set its fields"):
        config_schema.find("trainer")
    with pytest.raises(ConfigError, match="is set from batch_size; leave it out"):
        config_schema.find("batch.max_sequences")
    with pytest.raises(ConfigError, match="seed is not a dict"):
        config_schema.find("seed.x")
    with pytest.raises(ConfigError) as e:
        config_schema.find("nosuch")
    assert "did you mean" not in str(e.value)
