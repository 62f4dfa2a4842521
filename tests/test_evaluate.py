"""Evaluation: eval_lib.evaluate_problems metrics by hand, and `python -m pipelinerl_jax.evaluate`.

* A scripted fake sampler with hand-written completions scored by math-verify: avg@k,
  pass@k, statuses, finish reasons, lengths and per-source numbers computed by hand, with a
  sampler-rejected prompt and an unencodable one counted as errors, and a raising reward.
* The CLI on a tiny random Hugging Face model made here: with --greedy and a dataset whose
  gold answer for one question is transformers' own greedy continuation (exact-match reward
  defined below), avg@1 = pass@1 = 1/2 exactly; a run checkpoint of a procedural-task model
  (--workdir), sampled with k = 2, whose partial-credit scores match the written samples.
* Bad input: one-line errors, exit code 2.
"""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from pipelinerl_jax import evaluate, evaluate_settings
from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.data.prompts import PromptConfig
from pipelinerl_jax.data.tasks import CharTokenizer, make_task
from pipelinerl_jax.models import decoder
from pipelinerl_jax.models.tokenizer import Tokenizer
from pipelinerl_jax.pipeline import eval_lib
from pipelinerl_jax.rewards.tables import partial_credit
from pipelinerl_jax.rewards.workers import RewardPool
from pipelinerl_jax.sampler.sequence import SamplingParams
from pipelinerl_jax.train import checkpoint as ck
from pipelinerl_jax.train.trainer import TrainState
from tests.tiny_models import model_config


def exact_match(completion, problem):
    """Reward used by the CLI test (resolved as 'test_evaluate:exact_match')."""
    return float(completion.strip() == problem.answer.strip())


def broken_reward(completion, problem):
    """A reward function that always raises: every attempt ends in an error."""
    raise RuntimeError("the reward server is down")


# --- evaluate_problems with a scripted sampler -------------------------------------------------


class _Sample:
    def __init__(self, request_id, attempt, token_ids, finish_reason, error=None):
        self.request_id, self.attempt, self.token_ids = request_id, attempt, token_ids
        self.finish_reason, self.error = finish_reason, error


class ScriptedSampler:
    """Answers prompt text -> k scripted completions, a few per step, out of order."""

    def __init__(self, tokenizer, script, max_prompt):
        self.tok, self.script, self.max_prompt = tokenizer, script, max_prompt
        self.queue, self.next_id = [], 0

    def has_work(self):
        return bool(self.queue)

    def submit(self, ids, *, n, params):
        rid, self.next_id = self.next_id, self.next_id + 1
        text = self.tok.decode(ids, skip_special_tokens=True)
        for a in range(n):
            if len(ids) > self.max_prompt:
                self.queue.append(_Sample(rid, a, [], "error", "prompt too long"))
            else:
                completion, reason = self.script[text][a]
                self.queue.append(_Sample(rid, a, self.tok.encode(completion, False), reason))
        return rid

    def step(self):
        out, self.queue = self.queue[-3:][::-1], self.queue[:-3]
        return out


TOK = CharTokenizer(chars="0123456789+=\\boxed{}")
B = lambda x: "\\boxed{" + x + "}"
SCRIPT = {
    "1+1=": [(B("2"), "stop"), (B("3"), "stop"), ("22", "length"), (B("2"), "stop")],
    "2+2=": [(B("5"), "stop"), (B(""), "stop"), (B("5"), "stop"), (B("5"), "length")],
    "3+4=": [(B("7"), "stop")] * 4,
}
PROBLEMS = [
    Problem(uid="ds/0", question="1+1=", answer="2", source="ds"),
    Problem(uid="ds/1", question="2+2=", answer="4", source="ds"),
    Problem(uid="ds/2", question="1111111111=", answer="1", source="ds"),  # sampler rejects it
    Problem(uid="other/0", question="3+4=", answer="7", source="other"),
    Problem(uid="other/1", question="what?", answer="1", source="other"),  # not encodable
]
PLAIN = PromptConfig(template="plain", system_prompt=None)


def test_metrics_by_hand():
    sampler = ScriptedSampler(TOK, SCRIPT, max_prompt=6)
    res = eval_lib.evaluate_problems(
        sampler, TOK, PROBLEMS, "math", 4, SamplingParams(), PLAIN, return_samples=True
    )
    # correct attempts per problem: 2, 0, 0 (rejected), 4, 0 (not encodable)
    assert (res["num_problems"], res["k"], res["num_samples"]) == (5, 4, 20)
    assert res["avg@k"] == pytest.approx(6 / 20) and res["pass@k"] == pytest.approx(2 / 5)
    assert res["score_mean"] == pytest.approx(6 / 20)
    assert res["status"] == {
        "correct": 6,
        "wrong": 4,
        "no_answer": 1,
        "unparsable": 1,
        "error": 8,
        "timeout": 0,
    }
    assert res["finish"] == {"stop": 10, "length": 2, "error": 8}
    lengths = [len(c) for q in ("1+1=", "2+2=", "3+4=") for c, _ in SCRIPT[q]]
    assert res["len_mean"] == pytest.approx(np.mean(lengths))
    assert res["len_max"] == max(lengths) and res["no_eos_frac"] == pytest.approx(2 / 12)
    assert res["per_source"]["ds"]["avg@k"] == pytest.approx(2 / 12)
    assert res["per_source"]["ds"]["pass@k"] == pytest.approx(1 / 3)
    assert res["per_source"]["other"] == {
        "num_problems": 2,
        "avg@k": 0.5,
        "pass@k": 0.5,
        "score_mean": 0.5,
        "len_mean": 9.0,
    }
    rows = res["samples"]
    assert [(r["uid"], r["attempt"]) for r in rows] == [
        (p.uid, a) for p in PROBLEMS for a in range(4)
    ]
    assert rows[0]["completion"] == B("2") and rows[0]["predicted"] == "2"
    assert rows[8]["error"] == "prompt too long" and "cannot encode" in rows[16]["error"]


def _raises(completion, problem):
    if completion == B("3"):
        raise ZeroDivisionError("boom")
    return float(completion == B(problem.answer))


def test_reward_pool_and_raising_reward():
    sampler = ScriptedSampler(TOK, SCRIPT, max_prompt=6)
    with RewardPool(_raises, num_workers=0) as pool:
        res = eval_lib.evaluate_problems(
            sampler, TOK, PROBLEMS[:2], pool, 4, SamplingParams(), PLAIN, return_samples=True
        )
    assert res["status"]["error"] == 1 and res["status"]["correct"] == 2
    assert "ZeroDivisionError: boom" in res["samples"][1]["error"]
    busy = ScriptedSampler(TOK, SCRIPT, max_prompt=6)
    busy.submit(TOK.encode("1+1="), n=1, params=None)
    with pytest.raises(RuntimeError, match="idle sampler"):
        eval_lib.evaluate_problems(busy, TOK, PROBLEMS[:1], "math", 1, SamplingParams(), PLAIN)


# --- the CLI on a tiny Hugging Face model --------------------------------------------------

WORDS = "the a cat dog sat ran on mat far big small red blue one two three is was and or".split()
SPECIALS = ["<pad>", "<s>", "</s>", "[UNK]"]
QUESTIONS = ["the cat sat on", "two big dog"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "pad_token": "<pad>"})
    )
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.15,
        eos_token_id=vocab["</s>"],
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def _run(argv, capsys):
    code = evaluate.run_cli(["evaluate", "--progress=false", "--reward_workers=0"] + argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _greedy_text(model_dir, question, max_new_tokens):
    """transformers' greedy continuation of the prompt the evaluator builds."""
    tok = Tokenizer.from_dir(model_dir)
    ids = eval_lib.encode_problem(Problem("q", question, "", "q"), tok, PLAIN)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_ids[0],
            pad_token_id=0,
        )
    return tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)


def test_cli_greedy_matches_transformers_gold(model_dir, tmp_path, capsys):
    gold = _greedy_text(model_dir, QUESTIONS[0], 6)
    assert gold.strip()
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"question": QUESTIONS[0], "answer": gold})
        + "\n"
        + json.dumps({"question": QUESTIONS[1], "answer": "zzz"})
        + "\n"
    )
    out, samples = tmp_path / "res.json", tmp_path / "samples.jsonl"
    code, stdout, err = _run(
        [
            f"--model_dir={model_dir}",
            f"--dataset={data}",
            "--greedy",
            "--reward=test_evaluate:exact_match",
            "--system_prompt=",
            "--max_new_tokens=6",
            "--num_slots=4",
            "--chunk_steps=4",
            f"--out={out}",
            f"--samples_out={samples}",
        ],
        capsys,
    )
    assert code == 0, err
    res = json.loads(stdout)
    assert res == json.loads(out.read_text())
    assert (res["k"], res["avg@k"], res["pass@k"]) == (1, 0.5, 0.5)
    assert res["status"]["correct"] == 1 and res["status"]["wrong"] == 1
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert rows[0]["completion"] == gold and rows[0]["status"] == "correct"
    assert res["len_mean"] == np.mean([r["num_tokens"] for r in rows])


TASK_CFG = model_config(vocab_size=16, max_position_embeddings=32, tie_word_embeddings=True)


def test_cli_workdir_task_checkpoint(tmp_path, capsys):
    """A run checkpoint of a task model, sampled with k = 2 on the held-out problems and scored
    by partial credit."""
    rng = np.random.default_rng(1)
    params = jax.tree.map(
        lambda x: jax.numpy.asarray(0.3 * rng.standard_normal(x.shape), x.dtype),
        decoder.abstract_init(TASK_CFG)[1],
    )
    z = lambda v: jax.numpy.asarray(v, jax.numpy.int32)
    state = TrainState(
        step=z(5),
        version=z(5),
        params=params,
        opt_state=(),
        ref_params=None,
        skipped=z(0),
        consecutive_skips=z(0),
    )
    with ck.RunCheckpointer(tmp_path, model_config=TASK_CFG) as ckpt:
        ckpt.save(5, state, {})
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "data": {
                    "task": "reverse_digits",
                    "task_options": [["max_digits", 3], ["min_digits", 2]],
                }
            }
        )
    )
    samples = tmp_path / "s.jsonl"
    code, stdout, err = _run(
        [
            f"--workdir={tmp_path}",
            "--task=reverse_digits",
            "--num_problems=5",
            "--k=2",
            "--temperature=1.0",
            "--max_new_tokens=5",
            "--num_slots=8",
            "--chunk_steps=4",
            f"--samples_out={samples}",
        ],
        capsys,
    )
    assert code == 0, err
    assert "evaluating checkpoint step 5" in err
    res = json.loads(stdout)
    assert res["config"]["step"] == 5 and (res["num_problems"], res["k"]) == (5, 2)
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    # The held-out problems (another task seed), never the ones the run trained on.
    held_out = make_task("reverse_digits", max_digits=3, min_digits=2, seed=7919)
    trained = make_task("reverse_digits", max_digits=3, min_digits=2)
    assert [r["answer"] for r in rows] == [held_out.problem(i // 2).answer for i in range(10)]
    assert [r["answer"] for r in rows[::2]] != [trained.problem(i).answer for i in range(5)]
    assert res["finish"]["stop"] + res["finish"]["length"] == 10
    scores = [partial_credit(r["completion"], r["answer"]) for r in rows]
    assert res["score_mean"] == pytest.approx(np.mean(scores))


def _flags(*argv):
    from absl import flags

    fv = flags.FlagValues()
    evaluate.define_flags(fv)
    fv(["evaluate", *argv])
    return fv


def test_a_run_is_evaluated_with_its_own_prompt():
    """--workdir: the run's system prompt and few-shot examples, unless --system_prompt is
    given; a Hugging Face directory: the paper's prompt, no examples."""
    task = make_task("word_problems")
    run = {
        "data": {
            "prompt_template": "chat",
            "system_prompt": "Box it.",
            "few_shot": [["1+2?", "\\boxed{3}"]],
        }
    }
    cfg = evaluate_settings.prompt_config(_flags("--workdir=w", "--task=word_problems"), task, run)
    assert (cfg.template, cfg.system_prompt, cfg.few_shot) == (
        "chat",
        "Box it.",
        (("1+2?", "\\boxed{3}"),),
    )
    cfg = evaluate_settings.prompt_config(
        _flags("--workdir=w", "--task=word_problems", "--system_prompt=Other."), task, run
    )
    assert cfg.system_prompt == "Other." and cfg.few_shot == (("1+2?", "\\boxed{3}"),)
    cfg = evaluate_settings.prompt_config(
        _flags("--workdir=w", "--task=word_problems", "--nofew_shot"), task, run
    )
    assert cfg.system_prompt == "Box it." and cfg.few_shot == ()  # the run's, zero-shot
    papers = {"data": {"prompt_template": "chat", "system_prompt": None}}
    cfg = evaluate_settings.prompt_config(
        _flags("--workdir=w", "--task=word_problems"), task, papers
    )
    assert cfg.system_prompt == PromptConfig().system_prompt and cfg.few_shot == ()
    cfg = evaluate_settings.prompt_config(
        _flags("--model_dir=m", "--task=word_problems"), task, None
    )
    assert (cfg.template, cfg.system_prompt, cfg.few_shot) == (
        "chat",
        PromptConfig().system_prompt,
        (),
    )


def test_bad_inputs(model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "the cat", "answer": "1"}) + "\n")
    m, d = f"--model_dir={model_dir}", f"--dataset={data}"
    cases = [
        ([f"--model_dir={tmp_path / 'nope'}", d], "model directory does not exist"),
        ([m, f"--dataset={tmp_path / 'missing.jsonl'}"], "dataset file not found"),
        ([m, d, "--format=csv"], "unknown dataset format 'csv'"),
        ([m, f"--workdir={tmp_path}", d], "exactly one of --model_dir"),
        ([m], "exactly one of --dataset"),
        ([m, d, "--k=64", "--num_slots=8"], "--k=64 must be between 1 and --num_slots=8"),
        ([m, d, "--reward=no_such_module:fn"], "cannot import module 'no_such_module'"),
        ([f"--workdir={tmp_path}", d], "no checkpoints"),
        ([m, "--task=sort_letters"], "unknown task 'sort_letters'"),
        ([m, d, "--top_p=0"], "top_p=0.0 must be in (0, 1]"),
        ([m, d, "--page_size=0"], "--page_size=0 must be >= 1"),
        ([m, d, "--kv_memory_gb=-1"], "--kv_memory_gb=-1.0 must be >= 0"),
        ([m, d, "--reward_workers=-1"], "--reward_workers=-1 must be >= 0"),
        ([m, d, "--reward_timeout_s=3"], "--reward_timeout_s applies only with --reward_workers"),
        ([m, d, "--chat"], "has no chat template"),
        ([m, "--task=word_problems", "--task_options={difficulty: 1}"], "is not JSON"),
        ([m, "--task=word_problems", "--task_options=[1]"], "must be a JSON object"),
        ([m, "--task=word_problems", '--task_options={"difficulty": 9}'], "difficulty"),
        # Output paths it could not write: refused before the evaluation, not after it.
        ([m, d, f"--out={data / 'summary.json'}"], "its folder is not a writable directory"),
        ([m, d, f"--samples_out={tmp_path}"], f"--samples_out={tmp_path} is a directory"),
        (
            [m, d, f"--samples_out={data}"],
            f"--samples_out={data} is the --dataset file; name another file to write",
        ),
    ]
    before = data.read_text()
    for argv, message in cases:
        code, stdout, err = _run(argv, capsys)
        assert code == 2, (argv, err)
        assert message in err and err.startswith("error: ") and err.count("\n") == 1, err
        assert stdout == ""
    assert data.read_text() == before


def test_a_run_is_evaluated_with_its_own_generation_settings():
    """With --workdir, sampling settings not given as flags come from the run's config."""
    run = {"max_new_tokens": 144, "temperature": 0.8, "top_p": 0.95, "top_k": 7}
    assert evaluate_settings.generation(_flags(), run) == run
    given = _flags("--max_new_tokens=32", "--temperature=1.0")
    assert evaluate_settings.generation(given, run) == dict(run, max_new_tokens=32, temperature=1.0)
    # A Hugging Face directory has no run: the flags' defaults.
    assert evaluate_settings.generation(_flags(), None) == {
        "max_new_tokens": 512,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
    }


def test_a_multi_turn_run_is_evaluated_by_playing_its_environment(tmp_path, capsys):
    """evaluate --workdir of a run with config.env plays the run's environment (its options,
    turn limits), as the run's own held-out evaluation does: the same summary at the same
    checkpoint, not one-answer attempts scored as text."""
    from pipelinerl_jax import pipeline, presets

    cfg = presets.guess(
        steps=3, eval_every=3, checkpoint_every=3, log_every=0, eval={"num_problems": 8}
    )
    pipeline.run(cfg, str(tmp_path / "run"), echo=lambda *_: None)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    in_run = [r for r in records if r.get("kind") == "eval" and r["step"] == 3][-1]
    argv = [f"--workdir={tmp_path / 'run'}", "--task=guess_number", "--num_problems=8"]
    code, out, err = _run([*argv, "--greedy"], capsys)
    assert code == 0, err
    got = json.loads(out)
    assert got["config"]["env"]["name"] == "guess" and got["config"]["step"] == 3
    timing = {"kind", "time", "step", "eval_s", "episode/seconds_mean", "config"}
    assert {k: v for k, v in got.items() if k not in timing} == {
        k: v for k, v in in_run.items() if k not in timing
    }
    assert got["episode/turns_mean"] > 1
    same = lambda a, b: (
        {k: v for k, v in a.items() if k not in timing}
        == {k: v for k, v in b.items() if k not in timing}
    )
    # Without --task: the run's own task and options.
    code, out, err = _run([f"--workdir={tmp_path / 'run'}", "--num_problems=8", "--greedy"], capsys)
    assert code == 0 and same(json.loads(out), got), err
    # Exported, the model plays the same episodes when the flags give the run's limits.
    from pipelinerl_jax import export

    export.export(str(tmp_path / "run"), str(tmp_path / "hf"))
    env = cfg.env
    argv_hf = [
        f"--model_dir={tmp_path / 'hf'}",
        "--task=guess_number",
        "--num_problems=8",
        "--greedy",
        f"--max_new_tokens={cfg.max_new_tokens}",
        f"--env={env.name}",
        f"--env_options={json.dumps(dict(env.options))}",
        f"--env_max_turns={env.max_turns}",
        f"--env_turn_tokens={env.turn_tokens}",
    ]
    code, out, err = _run(argv_hf, capsys)
    assert code == 0 and same(json.loads(out), got), err
    code, _, err = _run([*argv_hf, "--env_turn_tokens=-1"], capsys)
    assert code == 2 and "--env_turn_tokens=-1 must be >= 0" in err
    # Another environment, or none, on request; bad environment flags are one line.
    code, out, _ = _run([*argv, "--greedy", "--env="], capsys)
    assert code == 0 and "episode/turns_mean" not in json.loads(out)
    for flags, words in [
        (["--env=nosuch"], "unknown environment 'nosuch'"),
        (["--env_options={bad"], "--env_options='{bad' is not JSON"),
        (["--env=", "--env_options={}"], "--env_options needs an environment"),
    ]:
        code, _, err = _run([*argv, *flags], capsys)
        assert code == 2 and words in err and err.count("\n") == 1, err


def test_an_environment_with_stop_strings_plays_on_a_model_dir(model_dir, tmp_path, capsys):
    """--env with a tool whose call ends at a stop string (python's closing fence): the sampler
    reads the turns' text; it was built without a detokenizer, and every attempt was an
    error with exit code 0."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in QUESTIONS))
    argv = [f"--model_dir={model_dir}", f"--dataset={data}", "--env=python", "--k=2"]
    argv.append('--env_options={"example": false}')  # the tiny model's 64 positions
    code, out, err = _run([*argv, "--max_new_tokens=6", "--num_slots=4", "--chunk_steps=4"], capsys)
    assert code == 0, err
    got = json.loads(out)
    assert got["num_samples"] == 4 and got["status"]["error"] == 0, got["status"]
    assert got["episode/turns_mean"] >= 1 and got["config"]["env"]["name"] == "python"


def test_every_attempt_an_error_is_said_and_exits_1(model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in QUESTIONS))
    argv = [f"--model_dir={model_dir}", f"--dataset={data}", "--greedy", "--max_new_tokens=4"]
    code, out, err = _run([*argv, "--reward=test_evaluate:broken_reward"], capsys)
    assert code == 1
    assert json.loads(out)["status"]["error"] == 2  # the summary is still printed
    assert err.count("\n") == 1 and "evaluate: 2 of 2 attempts ended in an error" in err
    assert "the reward server is down" in err
    code, _, err = _run([*argv, "--reward=test_evaluate:exact_match"], capsys)
    assert code == 0 and err == ""
