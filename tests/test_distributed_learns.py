"""RL learns across processes: 1 trainer + 2 sampler processes (`launch.py --spawn_local=3`)
raise the dense reward of test_rl_learns.py within thirty steps, as one process does, with
the lag bound held over both samplers and every trained token's version one the trainer had
published by then."""

import json

from tests.launching import launch
from tests.test_rl_learns import MAX_NEW, STEPS


def test_one_trainer_two_samplers_raise_a_dense_reward(tmp_path):
    """Same config and margin as test_rl_learns. Measured (seed 0, first 5 -> last 5 steps):
    one process 0.041 -> 0.550, these three processes 0.039 -> 0.558. Weights that never reach
    the sampler processes would leave it near the random policy's ~0.06. About 25 s."""
    flags = [
        "--config=configs/default.py",
        f"--config.steps={STEPS}",
        "--config.seed=0",
        "--config.group_size=4",
        "--config.batch_size=16",
        "--config.max_lag=1",
        "--config.log_every=0",
        "--config.eval_every=0",
        "--config.checkpoint_every=0",
        "--config.batch.filter_zero_std_groups=False",
        f"--config.generation.max_new_tokens={MAX_NEW}",
        "--config.sampler.num_slots=16",
        "--config.sampler.max_seq_len=24",
        "--config.sampler.page_size=16",
        "--config.sampler.chunk_steps=2",
        "--config.model.init.hidden_size=32",
        "--config.model.init.intermediate_size=64",
        "--config.model.init.num_heads=2",
        "--config.model.init.num_kv_heads=1",
        "--config.model.init.head_dim=16",
        "--config.trainer.learning_rate=5e-3",
        "--config.trainer.warmup_steps=0",
        "--config.reward.fn=tests.test_rl_learns:sevens",
        "--config.data.task_options.min_digits=1",
        "--config.data.task_options.max_digits=1",
        "--spawn_local=3",
        f"--workdir={tmp_path}",
    ]
    done = launch(*flags, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == list(range(STEPS))
    rewards = [r["reward/mean"] for r in train]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.15, rewards
    assert last - first > 0.2, rewards
    assert max(r["lag/token_max"] for r in train) <= train[0]["lag/bound"] == 1
    for r in train:
        assert 0 <= r["version/min"] <= r["version/max"] <= r["step"]
    served = [line for line in done.stdout.splitlines() if "stopped after" in line]
    assert len(served) == 2, done.stdout[-2000:]
