"""The reward process pool: hard timeouts, raising and dying rewards, clean shutdown, no orphans."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.data.tasks import make_task
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.rewards.math import verify_math
from pipelinerl_jax.rewards.tables import Verdict, reward_fn_spec
from pipelinerl_jax.rewards.workers import RewardPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 1.0
GOLD = Problem(uid="t/0", question="?", answer="\\frac{1}{2}", source="t")


# Reward functions the workers import from this module (they must be top-level to pickle).
def moody_reward(completion, problem):
    if completion == "sleep":
        time.sleep(10_000)
    if completion == "spin":  # a CPU-bound hang that ignores signals short of SIGKILL
        while True:
            pass
    if completion == "raise":
        raise RuntimeError("reward exploded")
    if completion == "exit":
        sys.exit(3)
    if completion == "die":
        os._exit(7)
    if completion == "text":
        return "1.0"
    if completion == "unpicklable":
        return Verdict("wrong", predicted=lambda: 0)
    return float(len(completion)) / 10


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _wait_workers(pool, n, seconds=20.0):
    deadline = time.monotonic() + seconds
    while len(pool.worker_pids()) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return pool.worker_pids()


@pytest.fixture(scope="module")
def pool():
    with RewardPool(moody_reward, num_workers=2, timeout_s=TIMEOUT_S) as p:
        yield p


def test_math_in_workers_matches_in_process():
    cases = ["\\boxed{0.5}", "\\boxed{\\frac{2}{4}}", "\\boxed{3}", "no box", "\\boxed{}"]
    with RewardPool(reward_fn_spec("math"), num_workers=2, timeout_s=30) as math_pool:
        got = math_pool.map([(c, GOLD) for c in cases])
    assert got == [verify_math(c, GOLD.answer) for c in cases]
    assert [v.status for v in got] == ["correct", "correct", "wrong", "no_answer", "unparsable"]


@pytest.mark.parametrize("hang", ["sleep", "spin"])
def test_hanging_reward_times_out_and_the_pool_survives(pool, hang):
    before = set(_wait_workers(pool, 2))
    restarts = pool.stats["restarts"]
    start = time.monotonic()
    stuck = pool.submit(hang, GOLD)
    # The other worker keeps serving while one is stuck.
    assert [pool.submit("abc", GOLD).result(timeout=10).score for _ in range(3)] == [0.3] * 3
    verdict = stuck.result(timeout=10)
    took = time.monotonic() - start
    assert verdict.status == "timeout" and verdict.score == 0.0
    assert TIMEOUT_S <= took < TIMEOUT_S + 3.0
    assert pool.stats["restarts"] == restarts + 1
    killed = before - set(pool.worker_pids())
    assert len(killed) == 1 and not _wait_gone(killed)
    after = _wait_workers(pool, 2)
    assert len(after) == 2
    assert pool.map([("abcd", GOLD), ("ab", GOLD)])[0].score == pytest.approx(0.4)


@pytest.mark.parametrize(
    "completion, detail",
    [
        ("raise", "RuntimeError: reward exploded"),
        ("exit", "SystemExit: 3"),
        ("text", "return a float or a pipelinerl_jax.rewards.tables.Verdict"),
        ("unpicklable", "result not picklable"),
    ],
)
def test_raising_reward_is_an_error_and_the_worker_stays(pool, completion, detail):
    pids = set(_wait_workers(pool, 2))
    restarts = pool.stats["restarts"]
    verdict = pool.submit(completion, GOLD).result(timeout=10)
    assert verdict.status == "error" and verdict.score == 0.0
    assert detail in verdict.detail
    assert pool.submit("a", GOLD).result(timeout=10).score == pytest.approx(0.1)
    assert set(pool.worker_pids()) == pids and pool.stats["restarts"] == restarts


def test_dying_worker_is_replaced(pool):
    restarts = pool.stats["restarts"]
    verdict = pool.submit("die", GOLD).result(timeout=10)
    assert verdict.status == "error" and "exit code 7" in verdict.detail
    assert pool.submit("abcde", GOLD).result(timeout=10).score == pytest.approx(0.5)
    assert pool.stats["restarts"] == restarts + 1


def test_close_stops_everything():
    p = RewardPool(moody_reward, num_workers=2, timeout_s=30)
    busy = p.submit("sleep", GOLD)
    pids = _wait_workers(p, 2)
    time.sleep(0.2)  # let the task reach a worker
    start = time.monotonic()
    p.close()
    assert time.monotonic() - start < 5
    verdict = busy.result(timeout=1)
    assert verdict.status == "error" and "closed" in verdict.detail
    assert not _wait_gone(pids)
    with pytest.raises(RuntimeError, match="closed"):
        p.submit("a", GOLD)


def test_killed_run_leaves_no_worker_behind(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent("""
        import os, signal, time
        from pipelinerl_jax.rewards.workers import RewardPool
        if __name__ == "__main__":
            pool = RewardPool("time:sleep", num_workers=2, timeout_s=600)
            futures = [pool.submit(10_000), pool.submit(10_000)]
            while len(pool.worker_pids()) < 2:
                time.sleep(0.02)
            time.sleep(0.3)
            print(" ".join(map(str, pool.worker_pids())), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == -9, out.stderr
    pids = [int(x) for x in out.stdout.split()]
    assert len(pids) == 2
    assert not _wait_gone(pids, seconds=10)


def test_inline_mode():
    task = make_task("reverse_digits")
    problem = task.problem(0)
    inline_task = RewardPool("task", num_workers=0)
    assert inline_task.submit(problem.answer, problem).result().status == "correct"
    p = RewardPool(moody_reward, num_workers=0)
    assert p.submit("abc", GOLD).result().score == pytest.approx(0.3)
    verdict = p.submit("raise", GOLD).result()
    assert verdict.status == "error" and "reward exploded" in verdict.detail
    assert p.worker_pids() == []
    p.close()


def test_bad_pool_configs():
    with pytest.raises(ConfigError, match="cannot be sent to worker processes"):
        RewardPool(lambda c, p: 1.0, num_workers=1)
    with pytest.raises(ConfigError, match="num_workers=-1"):
        RewardPool(moody_reward, num_workers=-1)
    with pytest.raises(ConfigError, match="timeout_s=0"):
        RewardPool(moody_reward, timeout_s=0)
    with pytest.raises(ConfigError, match="cannot import module"):
        RewardPool("no_such_rewards_module:f")
    with pytest.raises(ConfigError, match="start_method"):
        RewardPool(moody_reward, start_method="teleport")
