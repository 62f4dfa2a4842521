"""The embedded default (configs/default.py): it validates, stays PipelineRL, its docstring
matches its values, its task range avoids the partial-credit trap its docstring describes,
and rewards see every completion token (no special token can hide junk from the scorer).

No model is compiled here; test_pipeline_run.py runs the default end to end at reduced size
and bench/demo_seeds.py checks that it learns over 5 seeds.
"""

import random

import pytest

from configs import default as default_config
from pipelinerl_jax.data.tasks import CharTokenizer, make_task
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline import config_dict
from pipelinerl_jax.pipeline.components import model_config
from pipelinerl_jax.pipeline.groups import completion_text


@pytest.fixture(scope="module")
def cfg():
    return config_dict.from_config_dict(default_config.get_config())


def _task(cfg, **overrides):
    options = dict(cfg.data.task_options)
    options.update(overrides)
    return make_task(cfg.data.task, **options)


def test_default_is_pipeline_mode_with_in_flight_updates(cfg):
    assert cfg.mode == "pipeline"
    assert cfg.max_lag >= 1, "lag 0 would never let a swap land mid-sequence"
    assert cfg.sampler.kv_policy == "keep"
    assert cfg.batch_size % cfg.group_size == 0
    assert cfg.trainer.loss.entropy_coef > 0


def test_default_generation_fits_the_task_and_spans_several_chunks(cfg):
    task = _task(cfg)
    assert task.max_prompt_tokens <= cfg.max_prompt_tokens
    assert task.max_answer_tokens <= cfg.max_new_tokens, "the longest answer must fit"
    # A full answer takes more than one decode chunk, so weight swaps can land inside it.
    assert cfg.sampler.chunk_steps < task.max_answer_tokens


def test_docstring_states_the_configured_task_and_steps(cfg):
    doc = default_config.__doc__
    options = dict(cfg.data.task_options)
    assert f"reverse {options['min_digits']}-{options['max_digits']} digits" in doc
    assert f"{cfg.steps} steps" in doc
    assert f"lag\nbound {cfg.max_lag}" in doc or f"lag bound {cfg.max_lag}" in doc
    assert "python launch.py --config=configs/default.py" in doc


def _first_digit_policy_values(task, n=3000, seed=0):
    """Expected partial credit of a policy that knows only the first answer digit:
    (stop after it, add one uniformly random digit and stop)."""
    rng = random.Random(seed)
    stop = cont = 0.0
    for _ in range(n):
        answer = task.problem(rng.randrange(task.num_problems)).answer
        stop += _score(task, answer[0], answer)
        cont += sum(_score(task, answer[0] + str(d), answer) for d in range(10)) / 10
    return stop / n, cont / n


def _score(task, completion, answer):
    from pipelinerl_jax.data.formats import Problem

    return task.score(Problem(uid="t", question="", answer=answer, source=task.name), completion)


def test_task_range_has_no_stop_after_one_digit_trap(cfg):
    """With 1-digit answers in the mix, stopping after the first digit beats trying a second
    one (the trap the docstring names); from 2 digits on, trying is worth it."""
    stop, cont = _first_digit_policy_values(_task(cfg))
    assert cont > stop
    trap_stop, trap_cont = _first_digit_policy_values(_task(cfg, min_digits=1))
    assert trap_stop > trap_cont
    assert trap_stop == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 5, abs=0.03)


def test_rewards_see_special_tokens_but_not_the_final_stop():
    tok = CharTokenizer()
    stop_ids = (tok.eos_token_id,)
    ids = tok.encode("543", add_special_tokens=False)
    assert completion_text(tok, ids + [tok.eos_token_id], stop_ids) == "543"
    assert completion_text(tok, [tok.eos_token_id], stop_ids) == ""
    padded = completion_text(tok, ids + [tok.pad_token_id, tok.bos_token_id], stop_ids)
    assert padded == "543<pad><bos>"
    task = make_task("reverse_digits")
    # Padding instead of stopping must not score as the exact answer.
    assert _score(task, padded, "543") < _score(task, "543", "543") == 1.0
    # Only a final stop token is dropped: one in the middle is content the reward judges.
    middle = completion_text(tok, ids[:1] + [tok.eos_token_id] + ids[1:], stop_ids)
    assert middle == "5<eos>43"


def test_bad_override_of_the_default_fails_in_one_line():
    c = default_config.get_config()
    c.batch_size = c.group_size * 3 + 1
    with pytest.raises(ConfigError, match="not divisible by config.group_size"):
        config_dict.from_config_dict(c)
    c = default_config.get_config()
    c.sampler.attention = "flash"
    with pytest.raises(ConfigError, match="attention='flash'"):
        config_dict.from_config_dict(c)


def test_the_sampler_head_follows_the_loss_head_unless_set():
    """Behaviour logprobs come from the head the trainer uses (loss.head_dtype) unless
    sampler.head_dtype says otherwise; a 16-bit head halves its share of the memory estimate."""
    from pipelinerl_jax.pipeline import memory

    c = default_config.get_config()
    assert config_dict.from_config_dict(c).sampler.head_dtype == "float32"
    c.loss.head_dtype = "bfloat16"
    bf16 = config_dict.from_config_dict(c)
    assert bf16.sampler.head_dtype == "bfloat16" and bf16.trainer.loss.head_dtype == "bfloat16"
    c.sampler.head_dtype = "float32"
    mixed = config_dict.from_config_dict(c)
    assert mixed.sampler.head_dtype == "float32"
    m = model_config(bf16)
    saved = memory.estimate(mixed, m).sampler_params - memory.estimate(bf16, m).sampler_params
    head = m.vocab_size * m.hidden_size  # the decode copy's [V, E] head
    if m.tie_word_embeddings and m.compute_dtype == "float32":
        # A tied f32 head is the f32 table itself (forward.one_tied_table): the bf16 head is
        # an extra 2-byte copy, where the f32 one cost nothing.
        assert saved == -head * 2
    else:
        assert saved == head * 2  # 2 bytes less each
