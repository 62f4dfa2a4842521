"""The Python tool (envs/python_tool.py) and its sandbox (envs/sandbox.py): what a block prints,
its last expression, errors as their last line, time, memory and output limits with the whole
process group ended, no inherited environment, state across an episode's blocks, options
refused in one line, and whole episodes through the driver and a worker pool.
"""

import os
import pickle
import string
import time

import pytest

from pipelinerl_jax.data.formats import Problem
from pipelinerl_jax.data.tasks import CharTokenizer
from pipelinerl_jax.envs.codec import EpisodeCodec
from pipelinerl_jax.envs.python_tool import NO_OUTPUT, PythonTool, last_block
from pipelinerl_jax.envs.registry import make_env
from pipelinerl_jax.envs.runner import EnvironmentPool
from pipelinerl_jax.envs.sandbox import Limits, run_python
from pipelinerl_jax.errors import ConfigError
from pipelinerl_jax.pipeline.episodes import EpisodeDriver, episode_metrics, run_episodes
from pipelinerl_jax.pipeline.groups import completion_text
from pipelinerl_jax.sampler.protocol import Sample
from pipelinerl_jax.sampler.sequence import SamplingParams
from tests.config_args import run_config
from tests.test_episodes import ScriptedSampler

FAST = Limits(timeout_s=2.0)


def block(code: str, before: str = "Let me compute.\n") -> str:
    return f"{before}```python\n{code}\n```\n"


@pytest.mark.parametrize(
    "turn, code",
    [
        (block("print(1)"), "print(1)\n"),
        ("x\n```py\nprint(2)\n```", "print(2)\n"),  # ended at EOS, no newline after the fence
        ("```Python \nprint(3)\n```\n\n", "print(3)\n"),
        (block("a = 1") + "So \\boxed{1}.", None),  # went on after the block: an answer
        ("```python\nprint(4)\n", None),  # never closed: the token budget ran out
        ("The answer is \\boxed{7}.", None),
        ("```\nplain fence\n```\n", None),  # not Python
        (block("print(1)") + "```output\n1\n```\n" + block("print(5)", ""), "print(5)\n"),
    ],
)
def test_last_block(turn, code):
    assert last_block(turn) == code


def test_what_a_block_prints_and_its_last_expression():
    assert run_python("print(6 * 7)", FAST).output == "42\n"
    assert run_python("import math\nmath.comb(10, 3)", FAST).output == "120\n"
    assert run_python("x = 5\nx + 1\nNone", FAST).output == ""  # a None value shows nothing
    assert run_python("'a' * 3", FAST).output == "'aaa'\n"  # repr, as a notebook shows it
    r = run_python("import sys; sys.exit(0)", FAST)
    assert r.error is None


@pytest.mark.parametrize(
    "code, error",
    [
        ("print('before')\n1 / 0", "ZeroDivisionError: division by zero"),
        ("y + 1", "NameError: name 'y' is not defined"),
        ("def f(:\n  pass", "SyntaxError: "),
        ("import sys; sys.exit(3)", "SystemExit: 3"),
        ("raise ValueError('two\\nlines')", "ValueError: two"),
        ("bytearray(4 * 2**30)", "MemoryError"),
    ],
)
def test_errors_are_their_last_line(code, error):
    r = run_python(code, FAST)
    assert r.error.startswith(error) and "\n" not in r.error
    assert not r.timed_out
    if code.startswith("print"):
        assert r.output == "before\n"  # what it printed before failing stays


def test_a_block_that_runs_on_is_ended_with_what_it_started(tmp_path):
    # The block starts a grandchild that would outlive it, prints, then loops: the timeout
    # ends the whole process group, and what was printed before it comes back.
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "while True: pass\n"
    )
    r = run_python(code, Limits(timeout_s=1.0))
    assert r.timed_out and r.error == "timed out after 1s"
    pid = int(r.output.split()[0])
    for _ in range(50):  # SIGKILL was sent; the kernel reaps it (init adopts it) shortly
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {pid} still running after the timeout")


def test_output_is_cut_and_a_flood_stops_at_the_file_limit():
    r = run_python("print('x' * 5000)", Limits(max_output_chars=100))
    assert r.output == "x" * 100 + "...[cut]" and r.error is None
    r = run_python("while True: print('y' * 1000)", Limits(timeout_s=30.0, file_mb=1))
    assert r.output.startswith("y" * 100) and r.output.endswith("...[cut]")
    assert "File too large" in r.error and not r.timed_out  # stopped by the size, not the time


def test_the_child_inherits_no_environment_and_an_empty_folder(monkeypatch):
    monkeypatch.setenv("PRL_SECRET_TOKEN", "hunter2")
    r = run_python("import os\nprint(sorted(os.listdir('.')), 'PRL_SECRET_TOKEN' in os.environ)")
    assert r.output == "[] False\n"
    r = run_python("open('f.txt', 'w').write('hi')\nimport os\nos.getcwd()")
    cwd = r.output.strip().strip("'")
    assert cwd.endswith("/work") and not os.path.exists(cwd)  # removed after the call


def test_earlier_blocks_give_their_state_silently():
    earlier = ("x = 20", "print('not shown')", "1 / 0", "y = x + 1")
    r = run_python("x + y + 1", FAST, earlier)
    assert r.output == "42\n" and r.error is None


def test_an_earlier_block_that_looped_leaves_the_new_one_its_time():
    # It timed out in its own turn; rerun, it gets half the time and the new block runs
    # (without the cut the whole call would time out: no output, a timeout error).
    r = run_python("y * 21", Limits(timeout_s=2.0), ("y = 2", "while True: pass", "y = 3"))
    assert r.output == "42\n" and r.error is None and not r.timed_out
    # The block after the loop was skipped.


PROBLEM = Problem(uid="p/0", question="What is 37 times 12?", answer="444", source="p")


def test_respond_runs_the_block_and_scores_the_answer():
    env = PythonTool(timeout_s=2.0)
    turn = env.final(PROBLEM, [block("print(37 * 12)")])
    assert turn.observation == {"role": "text", "content": "```output\n444\n```\n"}
    assert not turn.done and turn.info == {"tool_calls": 1}
    # Ended at EOS right after the fence: the output starts on its own line.
    turn = env.final(PROBLEM, ["```python\n37 * 12\n```"])
    assert turn.observation["content"] == "\n```output\n444\n```\n"
    turn = env.final(PROBLEM, [block("n = 3")])
    assert turn.observation["content"] == f"```output\n{NO_OUTPUT}\n```\n"
    turn = env.final(PROBLEM, [block("print(1)\nundefined_name")])
    assert turn.observation["content"] == (
        "```output\n1\nError: NameError: name 'undefined_name' is not defined\n```\n"
    )
    assert turn.info == {"tool_calls": 1, "tool_errors": 1}
    done = env.final(PROBLEM, [block("print(444)"), "So there are \\boxed{444} pens."])
    assert done.done and done.reward == 1.0 and done.observation is None
    wrong = env.final(PROBLEM, ["\\boxed{440}"])
    assert wrong.done and wrong.reward == 0.0


def test_keep_state_runs_the_episodes_earlier_blocks():
    turns = [block("boxes = 37"), block("boxes * 12", "")]
    kept = PythonTool(timeout_s=2.0).final(PROBLEM, turns)
    assert kept.observation["content"] == "```output\n444\n```\n"
    fresh = PythonTool(timeout_s=2.0, keep_state=False).final(PROBLEM, turns)
    assert "NameError: name 'boxes' is not defined" in fresh.observation["content"]


def test_a_block_that_times_out_is_counted():
    env = PythonTool(timeout_s=0.5)
    turn = env.final(PROBLEM, [block("while True: pass")])
    assert "Error: timed out after 0.5s" in turn.observation["content"]
    assert turn.info == {"tool_calls": 1, "tool_errors": 1, "tool_timeouts": 1}


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"timeout_s": 0}, "option timeout_s=0 must be > 0 seconds"),
        ({"timeout_s": 700}, "option timeout_s=700 must be a finite number in [0, 600]"),
        ({"timeout_s": "3"}, "option timeout_s='3' must be a finite number"),
        ({"memory_mb": 10}, "option memory_mb=10 must be an int >= 64"),
        ({"max_output_chars": 0}, "option max_output_chars=0 must be an int >= 1"),
        ({"keep_state": "yes"}, "option keep_state='yes' must be"),
        ({"tiemout_s": 1}, "tiemout_s"),
    ],
)
def test_bad_options_are_one_line(options, expected):
    with pytest.raises(ConfigError) as e:
        make_env("python", options)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_the_run_config_checks_the_turn_fits_the_pools_timeout():
    cfg = run_config("--config.env.name=python", file="smollm2_math.py")
    assert cfg.env.make().limits.timeout_s == 3.0
    with pytest.raises(ConfigError) as e:
        run_config(
            "--config.env.name=python",
            '--config.env.options={"timeout_s": 4.5}',
            file="smollm2_math.py",
        )
    assert "which env.timeout_s=5 cuts short" in str(e.value)
    assert "raise env.timeout_s to at least 5.5" in str(e.value)
    run_config(
        "--config.env.name=python",
        '--config.env.options={"timeout_s": 4.5}',
        "--config.env.timeout_s=6",
        file="smollm2_math.py",
    )
    # A character task cannot write Python: refused before the run.
    with pytest.raises(ConfigError, match="cannot play the character task"):
        run_config("--config.env.name=python")


TOK = CharTokenizer("".join(dict.fromkeys(string.printable)))
EOS = TOK.eos_token_id


class ScriptedTexts(ScriptedSampler):
    """test_episodes' scripted sampler, saying scripted texts: one turn per step()."""

    def __init__(self, script: list[str]):
        super().__init__(seed=0)
        self.script, self.turn = script, {}

    def step(self):
        out = []
        for key in self.running:
            s = self.seqs[key]
            text = self.script[self.turn.get(key, 0)]
            ids = TOK.encode(text, add_special_tokens=False)
            ids += [] if text.endswith("```\n") else [EOS]  # a call ends at its stop string
            s.token_ids += ids
            s.logprobs += [-0.5] * len(ids)
            s.versions += [self.version] * len(ids)
            self.turn[key] = self.turn.get(key, 0) + 1
            self.parked.add(key)
            out.append(Sample(**{**vars(s), "token_ids": list(s.token_ids)}))
        self.running = []
        self.version += 1
        return out


@pytest.mark.parametrize("workers", [0, 1])
def test_an_episode_with_the_tool_in_a_worker_pool(workers):
    env = pickle.loads(pickle.dumps(PythonTool(timeout_s=2.0)))  # sent to workers as a pickle
    script = [
        block("pens = 37 * 12", "Each box holds 12 pens.\n"),
        block("print(pens)", ""),
        "So the boxes hold \\boxed{444} pens.",
    ]
    sampler = ScriptedTexts(script)
    with EnvironmentPool(num_workers=workers, timeout_s=5.0) as pool:
        turn_text = lambda ids: completion_text(TOK, ids, (EOS,))
        driver = EpisodeDriver(env, pool, EpisodeCodec(TOK), turn_text, max_new_tokens=400)
        params = SamplingParams(max_new_tokens=400)
        (episode,) = run_episodes(sampler, driver, [PROBLEM], n=1, params=params)
    assert episode.turns == 3 and episode.reward == 1.0 and episode.status == "correct"
    assert episode.counts == {"tool_calls": 2}
    s = episode.sample
    # The model's turns stay as said; the outputs sit between them at version -1.
    said = [t for t, v in zip(s.token_ids, s.versions) if v >= 0]
    text = TOK.decode(said, skip_special_tokens=True)
    assert text == "".join(script)
    shown = TOK.decode([t for t, v in zip(s.token_ids, s.versions) if v < 0])
    assert shown == f"```output\n{NO_OUTPUT}\n```\n```output\n444\n```\n"
    m = episode_metrics([episode])
    assert m["episode/tool_calls_mean"] == 2 and m["episode/error_frac"] == 0
