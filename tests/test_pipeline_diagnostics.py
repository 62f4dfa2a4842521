"""Reward diagnostics: status / finish fractions, one-time failure and zero-streak warnings,
sampled completions in samples.jsonl, robustness to malformed groups, and the real reward pool."""

import json

import pytest

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.pipeline.diagnostics import RewardDiagnostics
from pipelinerl_jax.pipeline.groups import Group
from pipelinerl_jax.rewards.tables import STATUSES, Verdict, get_reward_table
from pipelinerl_jax.rewards.workers import RewardPool
from pipelinerl_jax.sampler.sampler import Sample

SAMPLE_FIELDS = {
    "step",
    "group_pos",
    "group_index",
    "attempt",
    "uid",
    "pick",
    "prompt",
    "completion",
    "gold",
    "reward",
    "status",
    "predicted",
    "detail",
    "finish_reason",
    "num_tokens",
    "version_min",
    "version_max",
    "start_version",
}


# A reward function the pool's worker processes import from this module (top level: pickled).
def always_raises(completion, problem):
    return len(completion) / 0


def detok(ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)


def make_group(index, specs, *, versions=(3, 4), start_version=3):
    """specs: (status, reward, finish_reason[, n_tokens][, detail]) per attempt."""
    problem = Problem(uid=f"t/{index}", question="q", answer=str(index), source="t")
    group = Group(index=index, problem=problem, prompt_ids=[0, 1, 2])
    for i, spec in enumerate(specs):
        status, reward, finish = spec[:3]
        n = spec[3] if len(spec) > 3 else 4 + i
        detail = spec[4] if len(spec) > 4 else ""
        toks = [(index + i + j) % 26 for j in range(n)]
        vers = [versions[0]] * (n // 2) + [versions[1]] * (n - n // 2)
        group.samples.append(
            Sample(
                request_id=index,
                attempt=i,
                prompt_ids=[0, 1, 2],
                token_ids=toks,
                logprobs=[-0.5] * n,
                versions=vers,
                start_version=start_version,
                finish_reason=finish,
            )
        )
        group.verdicts.append(
            Verdict(
                status=status,
                score=float(status == "correct"),
                predicted=None if status == "no_answer" else f"p{i}",
                detail=detail,
            )
        )
        group.rewards.append(float(reward))
    return group


def zero_groups(n_groups=2, statuses=("no_answer",) * 7 + ("wrong",), finish="stop"):
    return [make_group(g, [(s, 0.0, finish) for s in statuses]) for g in range(n_groups)]


def mixed_groups(step=0):
    return [
        make_group(
            10 * step + g,
            [
                ("correct", 1.0, "stop"),
                ("wrong", 0.0, "stop"),
                ("no_answer", 0.0, "length"),
                ("unparsable", 0.0, "stop"),
                ("correct", 1.0, "stop"),
                ("wrong", 0.0, "length"),
            ],
        )
        for g in range(3)
    ]


class Echo(list):
    def __call__(self, line):
        assert "\n" not in line
        self.append(line)


def read_samples(workdir):
    path = workdir / "samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_status_and_finish_fractions_are_hand_counts():
    groups = [
        make_group(
            0,
            [
                ("correct", 1.0, "stop"),
                ("wrong", 0.0, "stop"),
                ("wrong", 0.0, "length"),
                ("no_answer", 0.0, "length"),
            ],
        ),
        make_group(
            1,
            [
                ("error", 0.0, "stop", 4, "ValueError: x"),
                ("timeout", 0.0, "stop", 4, "no verdict within 5 s"),
                ("unparsable", 0.0, "stop"),
                ("no_answer", 0.0, "length"),
            ],
        ),
    ]
    diag = RewardDiagnostics(None, echo=Echo())
    out = diag.record(1, groups, detok)
    assert {k: out[f"status/{k}"] for k in STATUSES} == {
        "correct": 1 / 8,
        "wrong": 2 / 8,
        "no_answer": 2 / 8,
        "unparsable": 1 / 8,
        "error": 1 / 8,
        "timeout": 1 / 8,
    }
    assert {k: out[f"status_count/{k}"] for k in STATUSES} == {
        "correct": 1,
        "wrong": 2,
        "no_answer": 2,
        "unparsable": 1,
        "error": 1,
        "timeout": 1,
    }
    assert out["finish/stop"] == 5 / 8 and out["finish/length"] == 3 / 8
    assert out["finish/other"] == 0.0
    assert out["reward/zero_streak"] == 0 and out["diag/malformed"] == 0
    assert all(isinstance(v, (int, float)) for v in out.values())


def test_all_six_status_keys_always_present():
    diag = RewardDiagnostics(None, echo=Echo())
    out = diag.record(1, [make_group(0, [("correct", 1.0, "stop")] * 3)], detok)
    assert {f"status/{s}" for s in STATUSES} <= set(out)
    assert out["status/correct"] == 1.0
    assert all(out[f"status/{s}"] == 0.0 for s in STATUSES if s != "correct")
    empty = diag.record(2, [], detok)  # nothing to count must not divide by zero
    assert all(empty[f"status/{s}"] == 0.0 for s in STATUSES)
    assert empty["finish/stop"] == 0.0 and empty["finish/length"] == 0.0


def test_reward_function_failure_is_echoed_once_with_its_text():
    echo = Echo()
    diag = RewardDiagnostics(None, echo=echo, zero_reward_warn_steps=0)
    ok = make_group(0, [("correct", 1.0, "stop")])
    diag.record(0, [ok], detok)
    assert echo == []
    for step in range(1, 20):
        failing = make_group(
            step,
            [("error", 0.0, "stop", 4, f"ZeroDivisionError: division by zero #{step}")] * 3
            + [("correct", 1.0, "stop")],
        )
        diag.record(step, [failing, ok], detok)
    assert len(echo) == 1
    line = echo[0]
    assert line.startswith("warning: reward function failed (status error) on step 1: ")
    assert "ZeroDivisionError: division by zero #1" in line
    assert "3 of 5 samples" in line and "status/error" in line and "problem t/1" in line
    # A timeout is a different kind of failure: announced once as well.
    for step in range(20, 25):
        diag.record(
            step, [make_group(step, [("timeout", 0.0, "stop", 4, "no verdict within 5 s")])], detok
        )
    assert len(echo) == 2
    assert echo[1].startswith("warning: reward function timed out (status timeout) on step 20")
    assert "no verdict within 5 s" in echo[1] and "status/timeout" in echo[1]


def test_multiline_failure_detail_is_one_line():
    echo = Echo()
    diag = RewardDiagnostics(None, echo=echo)
    diag.record(
        0, [make_group(0, [("error", 0.0, "stop", 4, "Traceback\n  line\nKeyError: 'x'")])], detok
    )
    assert len(echo) == 1 and "Traceback line KeyError: 'x'" in echo[0]


def test_zero_streak_warns_after_exactly_n_steps_and_once_per_streak(tmp_path):
    echo = Echo()
    n = 5
    diag = RewardDiagnostics(str(tmp_path), echo=echo, zero_reward_warn_steps=n, log_every=0)
    # 2 groups x (15 no_answer + 1 wrong) per step: no_answer 94%, wrong 6%.
    groups = zero_groups(statuses=("no_answer",) * 15 + ("wrong",))
    for step in range(n - 1):
        assert diag.record(step, groups, detok)["reward/zero_streak"] == step + 1
    assert echo == []
    assert diag.record(n - 1, groups, detok)["reward/zero_streak"] == n
    assert len(echo) == 1
    line = echo[0]
    assert line.startswith(f"warning: reward 0 for {n} steps in a row: no_answer 94%, wrong 6% (")
    assert "\\boxed{}" in line and "prompt" in line
    assert str(tmp_path / "samples.jsonl") in line
    for step in range(n, 3 * n):  # the same streak: no more warnings
        diag.record(step, groups, detok)
    assert len(echo) == 1 and diag.zero_streak == 3 * n

    # A nonzero step ends the streak; the next one warns again, with its own breakdown.
    out = diag.record(100, mixed_groups(), detok)
    assert out["reward/zero_streak"] == 0
    wrong = zero_groups(statuses=("wrong",) * 3 + ("no_answer",))
    for step in range(101, 101 + n - 1):
        diag.record(step, wrong, detok)
    assert len(echo) == 1
    diag.record(101 + n - 1, wrong, detok)
    assert len(echo) == 2
    assert echo[1].startswith(f"warning: reward 0 for {n} steps in a row: wrong 75%, no_answer 25%")
    assert "too hard" in echo[1] and "difficulty" in echo[1]


@pytest.mark.parametrize(
    "status, words",
    [
        ("error", "reward function raised"),
        ("timeout", "timed out"),
        ("unparsable", "answer format"),
    ],
)
def test_zero_streak_hint_follows_the_dominant_status(status, words):
    echo = Echo()
    diag = RewardDiagnostics(None, echo=echo, zero_reward_warn_steps=2)
    groups = zero_groups(statuses=(status,) * 3 + ("wrong",))
    diag.record(0, groups, detok)
    diag.record(1, groups, detok)
    streak = [line for line in echo if line.startswith("warning: reward 0")]
    assert len(streak) == 1 and words in streak[0]
    assert streak[0].startswith(f"warning: reward 0 for 2 steps in a row: {status} 75%, wrong 25%")
    assert "set a workdir" in streak[0]


def test_truncated_completions_add_a_length_hint():
    echo = Echo()
    diag = RewardDiagnostics(None, echo=echo, zero_reward_warn_steps=1)
    diag.record(0, zero_groups(finish="length"), detok)
    assert len(echo) == 1 and "max_new_tokens" in echo[0] and "100% hit the token limit" in echo[0]


def test_negative_rewards_are_not_a_zero_streak():
    diag = RewardDiagnostics(None, echo=Echo(), zero_reward_warn_steps=1)
    group = make_group(0, [("wrong", -0.25, "length"), ("wrong", 0.0, "stop")])
    assert diag.record(0, [group], detok)["reward/zero_streak"] == 0


def test_samples_written_on_log_steps_only(tmp_path):
    diag = RewardDiagnostics(str(tmp_path), echo=Echo(), samples_per_log=4, log_every=3)
    for step in range(8):
        diag.record(step, mixed_groups(step), detok)
    rows = read_samples(tmp_path)
    assert [r["step"] for r in rows] == [0] * 4 + [3] * 4 + [6] * 4
    for r in rows:
        assert SAMPLE_FIELDS <= set(r)
        assert "issues" not in r
        assert r["prompt"] == "abc"
        assert r["uid"] == f"t/{r['group_index']}" and r["gold"] == str(r["group_index"])
        assert r["group_index"] // 10 == r["step"]
        assert r["status"] in STATUSES and r["finish_reason"] in ("stop", "length")
        assert r["num_tokens"] == len(r["completion"]) == 4 + r["attempt"]
        assert (r["version_min"], r["version_max"], r["start_version"]) == (3, 4, 3)
        assert r["reward"] == (1.0 if r["status"] == "correct" else 0.0)
    for step in (0, 3, 6):
        picks = [r for r in rows if r["step"] == step]
        assert [p["pick"] for p in picks[:2]] == ["best", "worst"]
        assert picks[0]["reward"] == 1.0 and picks[1]["reward"] == 0.0
        # Diversity: four picks from four statuses (correct, and three of the zero ones).
        assert len({p["status"] for p in picks}) == 4
        assert len({(p["group_index"], p["attempt"]) for p in picks}) == 4


def test_samples_are_appended_never_rewritten(tmp_path):
    (tmp_path / "samples.jsonl").write_text('{"from": "an earlier run"}\n')
    diag = RewardDiagnostics(str(tmp_path), echo=Echo(), samples_per_log=2, log_every=1)
    diag.record(5, mixed_groups(), detok)
    rows = read_samples(tmp_path)
    assert rows[0] == {"from": "an earlier run"} and len(rows) == 3


def test_sample_selection_is_deterministic_in_seed_and_step(tmp_path):
    def picks(seed, name):
        workdir = tmp_path / name
        diag = RewardDiagnostics(
            str(workdir), echo=Echo(), samples_per_log=3, log_every=1, seed=seed
        )
        for step in range(6):
            # All rewards equal: only the seeded order decides which attempts are shown.
            diag.record(
                step, [make_group(g, [("wrong", 0.5, "stop")] * 8) for g in range(4)], detok
            )
        rows = read_samples(workdir)
        assert {r["pick"] for r in rows} == {"random"}  # tied rewards: no "best" / "worst"
        return [(r["step"], r["group_index"], r["attempt"]) for r in rows]

    first = picks(0, "a")
    assert len(first) == 18
    assert picks(0, "b") == first
    assert picks(1, "c") != first
    steps = {s: {(g, a) for t, g, a in first if t == s} for s in range(6)}
    assert len({frozenset(v) for v in steps.values()}) > 1  # the step enters the seed too


def test_no_file_without_workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    diag = RewardDiagnostics(None, echo=Echo(), log_every=1)
    for step in range(3):
        diag.record(step, mixed_groups(), detok)
    assert list(tmp_path.iterdir()) == []


def test_malformed_groups_and_failing_detokenize_do_not_crash(tmp_path):
    echo = Echo()
    diag = RewardDiagnostics(str(tmp_path), echo=echo, samples_per_log=10, log_every=1)
    good = make_group(0, [("wrong", 0.0, "stop"), ("correct", 1.0, "stop")])
    short = make_group(1, [("wrong", 0.0, "stop"), ("wrong", 0.0, "length")])
    short.verdicts = short.verdicts[:1]  # scored in part
    short.rewards = short.rewards[:1]
    odd = make_group(2, [("wrong", 0.0, "stop")])
    odd.verdicts = [{"score": 0.0}]  # a verdict without a status

    def bad_detok(ids):
        if len(ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return detok(ids)

    out = diag.record(0, [good, short, odd], bad_detok)
    assert out["diag/malformed"] == 2
    assert out["status/wrong"] == 2 / 5 and out["status/correct"] == 1 / 5
    assert out["diag/detokenize_errors"] == 5  # the prompt (3 tokens) of every record
    rows = read_samples(tmp_path)
    assert len(rows) == 5
    for r in rows:
        assert r["prompt"] == "<detokenize failed: UnicodeDecodeError>"
        assert any("detokenize prompt failed: UnicodeDecodeError" in i for i in r["issues"])
    by_key = {(r["group_index"], r["attempt"]): r for r in rows}
    assert "verdict missing" in by_key[(1, 1)]["issues"]
    assert "reward missing" in by_key[(1, 1)]["issues"]
    assert by_key[(1, 1)]["status"] == "missing" and by_key[(1, 1)]["reward"] is None
    assert any("verdict status None" in i for i in by_key[(2, 0)]["issues"])
    assert echo == []


def test_a_broken_group_object_is_reported_not_raised():
    echo = Echo()
    diag = RewardDiagnostics(None, echo=echo)

    class Exploding:
        @property
        def samples(self):
            raise RuntimeError("boom")

    out = diag.record(3, [Exploding()], detok)
    assert out["diag/internal_errors"] == 1 and {f"status/{s}" for s in STATUSES} <= set(out)
    assert len(echo) == 1 and echo[0].startswith("warning: reward diagnostics failed on step 3")
    assert "RuntimeError: boom" in echo[0]
    assert diag.record(4, [Exploding()], detok)["diag/internal_errors"] == 2
    assert len(echo) == 1


def test_raising_reward_in_the_real_pool_is_warned_on_the_first_step(tmp_path):
    table = get_reward_table("pure_success")
    groups = []
    with RewardPool(always_raises, num_workers=1, timeout_s=30) as pool:
        for g in range(2):
            group = make_group(g, [("wrong", 0.0, "stop")] * 3)
            futures = [pool.submit(detok(s.token_ids), group.problem) for s in group.samples]
            group.verdicts = [f.result(timeout=30) for f in futures]
            group.rewards = [
                table.compute(v, num_tokens=len(s.token_ids), max_tokens=64, finished=True).reward
                for v, s in zip(group.verdicts, group.samples)
            ]
            groups.append(group)
    echo = Echo()
    diag = RewardDiagnostics(str(tmp_path), echo=echo, zero_reward_warn_steps=1)
    out = diag.record(0, groups, detok)
    assert out["status/error"] == 1.0 and out["reward/zero_streak"] == 1
    assert echo[0].startswith(
        "warning: reward function failed (status error) on step 0: "
        "ZeroDivisionError: division by zero"
    )
    assert echo[1].startswith("warning: reward 0 for 1 step in a row: error 100%")
    assert "reward function raised" in echo[1]
    rows = read_samples(tmp_path)
    assert rows and all(r["status"] == "error" and "ZeroDivisionError" in r["detail"] for r in rows)
