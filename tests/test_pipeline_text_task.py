"""A text task end to end: word problems through a model's own tokenizer and chat template,
math-verify rewards in worker processes, answer statuses per step, samples.jsonl, the
zero-reward warning, held-out evaluation (of the starting policy too), and compile counts that
reach 0; and a reasoning_gym task, its dataset's scorer in a reward worker.

The model is a tiny random Llama with a byte-level BPE tokenizer (no merges: every byte is a
token, so any question encodes) written inside the test; it never answers in \\boxed{}, which
is exactly the "reward 0 and nothing says why" situation the diagnostics must explain.
"""

import json

import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from configs import default as default_config
from pipelinerl_jax.data.tasks import make_task
from pipelinerl_jax.pipeline import config_dict
from pipelinerl_jax.pipeline import runner as run_lib

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes_model")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "bos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": TEMPLATE,
            }
        )
    )
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def test_word_problems_run_explains_its_zero_reward(model_dir, tmp_path):
    c = default_config.get_config()
    c.steps, c.group_size, c.batch_size, c.max_lag, c.log_every = 5, 2, 4, 1, 1
    c.eval_every, c.checkpoint_every = 5, 0
    c.eval.num_problems = 2
    c.eval.at_start = True
    c.model.hf_dir, c.model.init = str(model_dir), {}
    c.data.task, c.data.task_options = "word_problems", dict(difficulty=1)
    c.data.prompt_template = "chat"
    c.generation.max_prompt_tokens, c.generation.max_new_tokens = 336, 8
    c.sampler.num_slots, c.sampler.max_seq_len, c.sampler.chunk_steps = 4, 352, 4
    c.sampler.prefill_chunk = 128
    c.sampler.min_window_pages = 22  # the whole context: one decode shape, as real configs do
    c.reward.fn, c.reward.workers = "math", 1
    cfg = config_dict.from_config_dict(c)
    lines = []
    summary = run_lib.run(cfg, str(tmp_path), echo=lines.append)
    assert summary["steps"] == 5

    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    # Every step counts its answer statuses; a random byte model never writes \boxed{}.
    for r in train:
        assert sum(
            r[f"status/{s}"]
            for s in ("correct", "wrong", "no_answer", "unparsable", "error", "timeout")
        ) == pytest.approx(1.0)
        assert r["status/no_answer"] == 1.0 and r["reward/mean"] == 0.0
    # ... and after 5 such steps the console says so, with the dominant status.
    warnings = [x for x in lines if x.startswith("warning: reward 0 for 5 steps")]
    assert len(warnings) == 1 and "no_answer 100%" in warnings[0]
    assert any("correct 0.00 answered 0.00" in x for x in lines)

    # Sampled completions with the chat-templated prompt, the question and the gold answer.
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and {s["step"] for s in samples} <= set(range(5))
    first = samples[0]
    assert first["prompt"].startswith("<|im_start|>system\nPlease reason step by step")
    assert first["uid"].startswith("word_problems/train/") and first["gold"].isdigit()

    # Held-out evaluation draws from the test split.
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 5]  # the starting policy, then the end
    assert any(x.startswith("eval at step 0:") and x.endswith("answered 0.00") for x in lines)

    # Compilations happen while warming up, none in the last steps.
    assert train[0]["compile/count"] > 0
    assert [r["compile/count"] for r in train[-2:]] == [0, 0]
    assert all(r["memory/peak_rss_gib"] > 0.1 for r in train)


def test_reasoning_gym_run_scores_in_a_reward_worker(model_dir, tmp_path):
    """A reasoning_gym task end to end: its problems through the chat prompt, its scorer in a
    reward worker process (every answer read, none an error), held-out problems evaluated."""
    c = default_config.get_config()
    c.steps, c.group_size, c.batch_size, c.max_lag, c.log_every = 3, 2, 4, 1, 1
    c.eval_every, c.checkpoint_every = 3, 0
    c.eval.num_problems = 2
    c.model.hf_dir, c.model.init = str(model_dir), {}
    c.data.task = "reasoning_gym"
    c.data.task_options = dict(name="chain_sum", size=64, config=dict(max_terms=3))
    c.data.prompt_template = "chat"
    c.generation.max_prompt_tokens, c.generation.max_new_tokens = 256, 8
    c.sampler.num_slots, c.sampler.max_seq_len, c.sampler.chunk_steps = 4, 272, 4
    c.sampler.prefill_chunk = 128
    c.sampler.min_window_pages = 17
    c.reward.fn, c.reward.workers = "reasoning_gym", 1
    cfg = config_dict.from_config_dict(c)
    lines = []
    summary = run_lib.run(cfg, str(tmp_path), echo=lines.append)
    assert summary["steps"] == 3

    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    # A random byte model writes no <answer> tags and no \boxed{}: every answer is read and
    # found missing, none fails or times out in the worker (the entry reached it).
    assert len(train) == 3
    for r in train:
        assert r["status/no_answer"] == 1.0 and r["status/error"] == 0.0, r
        assert r["status/timeout"] == 0.0 and r["reward/mean"] == 0.0
    assert not any(x.startswith("warning: reward function failed") for x in lines), lines

    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    task = make_task("reasoning_gym", **dict(cfg.data.task_options))
    for s in samples:
        assert s["uid"].startswith("reasoning_gym/chain_sum/train/")
        problem = task.problem(int(s["uid"].rsplit("/", 1)[1]))
        assert s["gold"] == problem.answer and problem.question in s["prompt"]

    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3]
    assert list(evals[0]["per_source"]) == ["reasoning_gym/chain_sum"]
