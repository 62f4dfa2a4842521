"""Config fields that reach the run: model.remat, data.system_prompt, data.few_shot,
reward.table_options, compile_cache; bad values are one-line ConfigErrors before anything is built."""

import pytest

from configs import default as default_config
from pipelinerl_jax.data.prompts import DEFAULT_SYSTEM_PROMPT, build_messages
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import components as build_lib
from pipelinerl_jax.pipeline import config as config_lib
from pipelinerl_jax.pipeline import config_dict


def _cfg(**overrides):
    c = default_config.get_config()
    for key, value in overrides.items():
        node = c
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return config_dict.from_config_dict(c)


def test_remat_reaches_the_model_config():
    assert build_lib.model_config(_cfg(**{"model.remat": True})).remat is True
    assert build_lib.model_config(_cfg()).remat is False
    both = {"model.remat": True, "model.remat_policy": "matmuls"}
    assert build_lib.model_config(_cfg(**both)).remat_policy == "matmuls"
    assert build_lib.model_config(_cfg()).remat_policy == "attention"


# A text task: prompts (system prompt, worked examples) apply to text tasks alone.
TEXT = {"data.task": "word_problems", "data.task_options": {}, "reward.fn": "math"}


def test_system_prompt_default_custom_and_none():
    default = build_lib.prompt_config(_cfg(**TEXT).data)
    assert default.system_prompt == DEFAULT_SYSTEM_PROMPT
    custom = build_lib.prompt_config(_cfg(**TEXT, **{"data.system_prompt": "Box it."}).data)
    assert build_messages("2+2?", custom)[0] == {"role": "system", "content": "Box it."}
    none = build_lib.prompt_config(_cfg(**TEXT, **{"data.system_prompt": ""}).data)
    assert [m["role"] for m in build_messages("2+2?", none)] == ["user"]


def test_few_shot_reaches_the_prompt_and_rejects_bad_items():
    shot = dict(question="1+2?", answer="The answer is \\boxed{3}.")
    cfg = _cfg(**TEXT, **{"data.few_shot": [shot]})
    assert cfg.data.few_shot == (("1+2?", "The answer is \\boxed{3}."),)
    messages = build_messages("7+1?", build_lib.prompt_config(cfg.data))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == shot["answer"]
    assert config_lib.as_dict(cfg)["data"]["few_shot"] == [["1+2?", shot["answer"]]]
    for bad in ([dict(question="1+2?")], [dict(question="1+2?", answer="")], ["1+2? 3"]):
        with pytest.raises(ConfigError, match=r"data.few_shot\[0\]") as e:
            _cfg(**TEXT, **{"data.few_shot": bad})
        assert "\n" not in str(e.value)


def test_prompt_fields_on_a_character_task_are_refused():
    for field, value in (("data.system_prompt", "Box it."), ("data.few_shot", [["1", "2"]])):
        with pytest.raises(ConfigError, match=f"config.{field} does not apply to data.task="):
            _cfg(**{field: value})


def test_reward_table_options_override_and_reject_unknown():
    cfg = _cfg(
        **{"reward.table": "success_and_format", "reward.table_options": {"format_weight": 0.3}}
    )
    assert dict(cfg.reward.table_options) == {"format_weight": 0.3}
    with pytest.raises(ConfigError, match="unknown option") as e:
        _cfg(**{"reward.table_options": {"format_wieght": 0.3}})
    assert "\n" not in str(e.value)


def test_compile_cache_field():
    assert _cfg().compile_cache == "auto"
    assert _cfg(compile_cache="").compile_cache == ""
