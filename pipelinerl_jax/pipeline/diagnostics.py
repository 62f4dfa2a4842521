"""Why a reward is what it is: per-step answer statuses, loud warnings, and sampled completions.

A run whose reward sits at exactly 0 learns nothing (every advantage is 0), and the mean reward
alone cannot say whether the model never wrote an answer, wrote wrong ones, or the reward
function crashed on every completion. `RewardDiagnostics` is called by the trainer thread once
per optimizer step with the step's scored groups and

  * returns flat scalar metrics for the step's record: the fraction (`status/<s>`) and count
    (`status_count/<s>`) of every verdict status, always all six; finish reasons
    (`finish/stop`, `finish/length`, `finish/other`); `reward/zero_streak`, the number of
    consecutive steps whose mean reward was exactly 0; and `diag/malformed`,
    `diag/detokenize_errors` for records this module had to patch up;
  * echoes one-line `warning:` messages: the first `error` and the first `timeout` verdict of
    the run with its detail text (the exception), and, once per streak, reward 0 for
    `zero_reward_warn_steps` steps in a row with the status breakdown and a hint;
  * every `log_every` steps appends `samples_per_log` completions, picked deterministically from
    (seed, step) and for diversity (best, worst, unseen statuses), to `<workdir>/samples.jsonl`.

Nothing here may stop a run: a malformed group or a failing detokenizer is counted and written
as a placeholder with the reason, and an unexpected failure of the diagnostics themselves is
echoed once and counted in `diag/internal_errors`.
"""

from __future__ import annotations

import collections
import json
import math
import random
from pathlib import Path

from pipelinerl_jax.rewards.tables import STATUSES

FINISH_KEYS = ("stop", "length")
# The two failure statuses a reward function (or its pool) produces; each is announced once.
FAILURE_STATUSES = ("error", "timeout")
MISSING = "missing"  # the status of an entry without a usable verdict

# What to try when a zero-reward streak is dominated by a status.
HINTS = {
    "no_answer": "no answer (e.g. no \\boxed{}) in most completions: check the prompt template "
    "asks for the format the reward function reads, or add a format reward",
    "unparsable": "answers were found but could not be parsed: check the answer format the "
    "reward function expects",
    "wrong": "answers parsed but were wrong: the task may be too hard for this model; lower "
    "the difficulty or use an easier dataset",
    "error": "the reward function raised on most completions: fix it (the first failure was "
    "echoed above)",
    "timeout": "the reward function timed out on most completions: make it faster or raise "
    "the reward timeout",
    "correct": "completions are correct but rewarded 0: check the reward table's weights",
    MISSING: "most verdicts are missing or malformed: check the reward function's return value",
}


def _get(obj, name, default=None):
    """A field of a dataclass-like object or dict; default when it is absent."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _at(seq, i):
    """seq[i], or None when seq is missing or too short (a group scored only in part)."""
    try:
        return seq[i]
    except (IndexError, TypeError, KeyError):
        return None


def _len(value) -> int:
    try:
        return len(value)
    except TypeError:  # None, or something that is not a list at all
        return 0


def _as_float(value) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out


def _one_line(text, limit: int = 400) -> str:
    """Echoed lines stay one line: exception texts may carry newlines and tracebacks."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _percentages(counts: collections.Counter) -> str:
    """'no_answer 94%, wrong 6%': non-zero statuses, most frequent first."""
    total = sum(counts.values())
    if not total:
        return "no samples"
    order = list(STATUSES) + [MISSING]
    items = sorted(
        (k for k in counts if counts[k]),
        key=lambda k: (-counts[k], order.index(k) if k in order else len(order)),
    )
    return ", ".join(f"{k} {round(100 * counts[k] / total)}%" for k in items)


class _Entry:
    """One attempt of a step, read defensively: everything the metrics and samples need."""

    __slots__ = (
        "group_pos",
        "group",
        "attempt",
        "sample",
        "verdict",
        "reward",
        "status",
        "finish",
        "issues",
    )

    def __init__(self, group_pos, group, attempt):
        self.group_pos, self.group, self.attempt = group_pos, group, attempt
        self.issues: list[str] = []
        self.sample = _at(_get(group, "samples"), attempt)
        self.verdict = _at(_get(group, "verdicts"), attempt)
        self.reward = _as_float(_at(_get(group, "rewards"), attempt))
        status = _get(self.verdict, "status")
        if self.sample is None:
            self.issues.append("sample missing")
        if self.verdict is None:
            self.issues.append("verdict missing")
        elif status not in STATUSES:
            self.issues.append(f"verdict status {status!r} is not one of {STATUSES}")
        if self.reward is None:
            self.issues.append("reward missing")
        self.status = status if status in STATUSES else MISSING
        finish = _get(self.sample, "finish_reason")
        self.finish = finish if finish in FINISH_KEYS else "other"


class RewardDiagnostics:
    """Per-step reward diagnostics for the trainer thread (not thread-safe: one caller)."""

    def __init__(
        self,
        workdir: str | None,
        *,
        echo=print,
        zero_reward_warn_steps: int = 5,
        samples_per_log: int = 4,
        log_every: int = 10,
        seed: int = 0,
    ):
        self.workdir = Path(workdir) if workdir else None
        self.samples_path = self.workdir / "samples.jsonl" if self.workdir else None
        self.echo = echo
        self.zero_reward_warn_steps = int(zero_reward_warn_steps)
        self.samples_per_log = int(samples_per_log)
        self.log_every = int(log_every)
        self.seed = int(seed)
        self.zero_streak = 0
        self._streak_statuses: collections.Counter = collections.Counter()
        self._streak_finish: collections.Counter = collections.Counter()
        self._streak_warned = False
        self._failures_echoed: set[str] = set()
        self._internal_errors = 0
        self._internal_echoed = False
        self._write_failed = False

    # --- the per-step entry point ----------------------------------------------------------

    def record(self, step: int, groups: list, detokenize) -> dict:
        """Metrics of one optimizer step's groups (see the module docstring for the keys)."""
        try:
            return self._record(step, groups, detokenize)
        except Exception as e:  # noqa: BLE001 - diagnostics must never stop training
            # Not silent: said once, then counted, so a broken diagnostic shows in metrics.
            self._internal_errors += 1
            if not self._internal_echoed:
                self._internal_echoed = True
                self.echo(
                    f"warning: reward diagnostics failed on step {step}: "
                    f"{_one_line(f'{type(e).__name__}: {e}')}; training continues, "
                    "further failures are counted in diag/internal_errors"
                )
            out = {f"status/{s}": math.nan for s in STATUSES}
            out["reward/zero_streak"] = self.zero_streak
            out["diag/internal_errors"] = self._internal_errors
            return out

    def _record(self, step, groups, detokenize) -> dict:
        entries = []
        for pos, group in enumerate(groups or []):
            n = max(_len(_get(group, name)) for name in ("samples", "verdicts", "rewards"))
            entries.extend(_Entry(pos, group, i) for i in range(n))
        statuses = collections.Counter(e.status for e in entries)
        finishes = collections.Counter(e.finish for e in entries)
        total = len(entries)

        out = {}
        for s in STATUSES:
            out[f"status/{s}"] = statuses[s] / total if total else 0.0
            out[f"status_count/{s}"] = statuses[s]
        for f in FINISH_KEYS + ("other",):
            out[f"finish/{f}"] = finishes[f] / total if total else 0.0
        out["diag/malformed"] = sum(1 for e in entries if e.issues)

        self._announce_failures(step, entries)
        self._update_streak(step, entries, statuses, finishes)
        out["reward/zero_streak"] = self.zero_streak

        out["diag/detokenize_errors"] = 0
        if (
            self.samples_path is not None
            and self.log_every > 0
            and self.samples_per_log > 0
            and step % self.log_every == 0
            and entries
        ):
            out["diag/detokenize_errors"] = self._write_samples(step, entries, detokenize)
        if self._internal_errors:
            out["diag/internal_errors"] = self._internal_errors
        return out

    # --- warnings -------------------------------------------------------------------------

    def _announce_failures(self, step, entries) -> None:
        """The first error / timeout verdict of the run, with its text: the one line that says
        why a reward function returns nothing. Later ones only count (status/error...)."""
        for kind in FAILURE_STATUSES:
            if kind in self._failures_echoed:
                continue
            failed = [e for e in entries if e.status == kind]
            if not failed:
                continue
            self._failures_echoed.add(kind)
            first = failed[0]
            detail = _one_line(_get(first.verdict, "detail") or "") or "no detail recorded"
            uid = _get(_get(first.group, "problem"), "uid")
            what = "failed" if kind == "error" else "timed out"
            plural = "failures" if kind == "error" else "timeouts"
            self.echo(
                f"warning: reward function {what} (status {kind}) on step {step}: "
                f"{detail} ({len(failed)} of {len(entries)} samples this step; problem "
                f"{uid}); further {plural} are counted in status/{kind}"
            )

    def _update_streak(self, step, entries, statuses, finishes) -> None:
        rewards = [e.reward for e in entries if e.reward is not None]
        if not rewards:
            return  # no reward at all: nothing to say about its mean; the streak stands
        if sum(rewards) / len(rewards) != 0.0:
            self.zero_streak = 0
            self._streak_statuses.clear()
            self._streak_finish.clear()
            self._streak_warned = False
            return
        self.zero_streak += 1
        self._streak_statuses.update(statuses)
        self._streak_finish.update(finishes)
        if (
            self._streak_warned
            or self.zero_reward_warn_steps <= 0
            or self.zero_streak < self.zero_reward_warn_steps
        ):
            return
        self._streak_warned = True  # once per streak; a nonzero step re-arms it
        order = list(STATUSES) + [MISSING]
        dominant = max(
            self._streak_statuses, key=lambda k: (self._streak_statuses[k], -order.index(k))
        )
        hint = HINTS[dominant]
        n = sum(self._streak_finish.values())
        if n and self._streak_finish["length"] / n > 0.5:
            # Truncated completions rarely hold an answer: the likelier cause of no_answer.
            hint += (
                f"; {round(100 * self._streak_finish['length'] / n)}% hit the token "
                "limit before EOS: raise max_new_tokens or ask for shorter answers"
            )
        where = (
            f"see {self.samples_path}"
            if self.samples_path is not None
            else "set a workdir to keep sampled completions"
        )
        steps = "step" if self.zero_streak == 1 else "steps"
        self.echo(
            f"warning: reward 0 for {self.zero_streak} {steps} in a row: "
            f"{_percentages(self._streak_statuses)} ({hint}; {where})"
        )

    # --- sampled completions --------------------------------------------------------------

    def pick(self, step: int, entries: list) -> list[tuple[object, str]]:
        """Up to samples_per_log (entry, why) pairs: the best and the worst reward, then one of
        each status not yet shown, then random. Deterministic in (seed, step)."""
        # A string seed is hashed with sha512, not hash(): the same picks on every run.
        rng = random.Random(f"reward-diagnostics:{self.seed}:{step}")
        pool = list(entries)
        rng.shuffle(pool)  # ties below are broken by this order, not by position
        chosen: list[tuple[object, str]] = []

        def take(entry, why):
            pool.remove(entry)
            chosen.append((entry, why))

        scored = [e for e in pool if e.reward is not None]
        if scored:
            take(max(scored, key=lambda e: e.reward), "best")
            worst = [e for e in pool if e.reward is not None and e.reward < chosen[0][0].reward]
            if not worst:  # every reward tied: "best" would mislead whoever reads the file
                chosen[0] = (chosen[0][0], "random")
            elif len(chosen) < self.samples_per_log:
                take(min(worst, key=lambda e: e.reward), "worst")
        shown = {e.status for e, _ in chosen}
        for e in list(pool):
            if len(chosen) >= self.samples_per_log:
                break
            if e.status not in shown:
                shown.add(e.status)
                take(e, f"status {e.status}")
        while pool and len(chosen) < self.samples_per_log:
            take(pool[0], "random")
        return chosen[: self.samples_per_log]

    def _text(self, detokenize, ids, what, issues) -> str | None:
        if ids is None:
            issues.append(f"{what} token ids missing")
            return None
        try:
            return str(detokenize(list(ids)))
        except Exception as e:  # noqa: BLE001 - a placeholder, with the reason in the record
            issues.append(f"detokenize {what} failed: {_one_line(f'{type(e).__name__}: {e}', 200)}")
            return f"<detokenize failed: {type(e).__name__}>"

    def _sample_record(self, step, entry, why, detokenize) -> dict:
        issues = list(entry.issues)
        group, sample, verdict = entry.group, entry.sample, entry.verdict
        problem = _get(group, "problem")
        token_ids = _get(sample, "token_ids")
        versions = [v for v in (_get(sample, "versions") or []) if v is not None]
        rec = {
            "step": step,
            "group_pos": entry.group_pos,  # position in the step's batch
            "group_index": _get(group, "index"),  # admission's start index
            "attempt": entry.attempt,
            "uid": _get(problem, "uid"),
            "pick": why,
            "prompt": self._text(detokenize, _get(group, "prompt_ids"), "prompt", issues),
            "completion": self._text(detokenize, token_ids, "completion", issues),
            "gold": _get(problem, "answer"),
            "reward": entry.reward,
            "status": _get(verdict, "status", MISSING),
            "predicted": _get(verdict, "predicted"),
            "detail": _get(verdict, "detail") or None,
            "finish_reason": _get(sample, "finish_reason"),
            "num_tokens": len(token_ids) if token_ids is not None else None,
            "version_min": min(versions) if versions else None,
            "version_max": max(versions) if versions else None,
            "start_version": _get(sample, "start_version"),
        }
        if issues:
            rec["issues"] = issues
        return rec

    def _write_samples(self, step, entries, detokenize) -> int:
        """Appends the step's picks; returns how many detokenize calls failed."""
        records = [
            self._sample_record(step, e, why, detokenize) for e, why in self.pick(step, entries)
        ]
        failures = sum(
            1 for r in records for i in r.get("issues", ()) if i.startswith("detokenize")
        )
        if self._write_failed:
            return failures
        try:
            self.samples_path.parent.mkdir(parents=True, exist_ok=True)
            # Append only, a flush per line: a killed run loses at most the line in flight, and
            # a resumed run adds to what the first one wrote.
            with self.samples_path.open("a", encoding="utf-8") as f:
                for rec in records:
                    f.write(json.dumps(rec, ensure_ascii=False, default=str) + "\n")
                    f.flush()
        except OSError as e:
            # A full disk must not stop training; say it once and stop trying.
            self._write_failed = True
            self.echo(
                f"warning: cannot append to {self.samples_path}: "
                f"{_one_line(e)}; sampled completions are no longer written"
            )
        return failures
