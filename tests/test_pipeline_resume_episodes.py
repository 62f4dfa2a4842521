"""Kill -9 a run of multi-turn episodes between two turns, resume it from its workdir:
every prompt is trained once, in start order, as test_pipeline_resume.py checks of one-turn
runs. Half the problems' environment turns take 0.05 s, so checkpoints find groups whose
episodes are parked waiting for their environment (two workers answer sixteen episodes);
those groups are regenerated from their prompt after the resume (a sampler's KV pages do not
outlive its process), never lost and never trained twice. Its own file, so the test runner spreads it apart from the one-turn run.
"""

import time
import zlib

from pipelinerl_jax.envs.guess import GuessNumber
from tests.test_pipeline_resume import check_kill_9_then_resume

EPISODE_FLAGS = [
    "--config=configs/guess.py",
    "--config.max_lag=3",
    "--config.steps=10",
    "--config.group_size=4",
    "--config.batch_size=16",
    "--config.sampler.num_slots=16",
    "--config.eval_every=0",
    "--config.log_every=1",
    "--config.checkpoint_every=2",
    "--config.checkpoint_keep=8",
    "--config.env.name=tests.test_pipeline_resume_episodes:SlowGuess",
    "--config.env.workers=2",
]


class SlowGuess(GuessNumber):
    """The guess environment, 0.05 s late on every turn of half the problems: checkpoints find
    episodes parked between turns, waiting for their environment. (At 0.2 s an uninterrupted
    run took 63 s, nearly all of it the workers sleeping, at 0.05 s 25 s; every checkpoint
    held groups in flight at either delay.)"""

    def respond(self, problem, turns):
        if zlib.crc32(problem.uid.encode()) % 2 == 0:
            time.sleep(0.05)
        return super().respond(problem, turns)


def test_episodes_killed_between_turns_resume_and_train_every_prompt_once(tmp_path):
    # Killed at the first checkpoint with groups whose episodes are still running (between
    # turns): whether scored groups wait beside them depends on timing alone.
    check_kill_9_then_resume(tmp_path, EPISODE_FLAGS, "configs/guess.py", need_scored=False)
