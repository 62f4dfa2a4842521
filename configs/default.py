"""The embedded default: a tiny decoder learns to reverse digit strings on CPU, in pipeline mode.

    python launch.py --config=configs/default.py --workdir=/tmp/prl_default
    make run                                   # the same, with a fresh workdir under runs/

A 2-layer, d=128 Llama-style decoder (~0.4M params) starts from random weights and is trained
with PPO's clipped objective (group-mean baseline, entropy bonus) on "reverse 2-5 digits"
(`12345=` -> `54321<eos>`; partial credit = correct positions / the longer length). Generation
and training run in two threads; after every optimizer step the new weights are swapped into
the sampler between two decode chunks, so sequences mix tokens of two policy versions (lag
bound 2).

What you should see (1000 steps; ~2 min on 2 idle cores, ~6 min on a busy machine): reward
~0.03 (random) for the first ~100-200 steps, then the model learns the first digit and where
to stop, and the sampled reward climbs, with dips, to ~0.5 by step ~500 and ~0.6 over the
last tenth (held-out greedy: ~1/3 exact); later digits come slowly. The final `done:` line
shows reward (first 20 steps) -> (last tenth), sequences with >1 version and the lag
histogram. bench/demo_seeds.py checks 5 seeds (--seeds for more). Why these values: with
1-digit answers in the mix (1-5 digits), "say the last digit, stop" scores 0.46 and stays
ahead of trying a second digit, a trap every 1-5 run stayed in;
lr 2e-3 made the policy fall back to near-uniform, no entropy bonus (or 0.05) collapsed (or
flattened) it, and zero-std group filtering or per-group std normalisation learned slower.
1000 steps rather than 800: where the sampler outruns the trainer, nearly every token is at the
lag bound and learning is slower; the extra steps bring the last tenth nearer the plateau.
PPO rather than the paper's truncated-IS REINFORCE: with nearly every token two versions stale,
REINFORCE stalled now and then (one seed-run in ten to fifteen, at 800 steps and at 1000, its
last tenth near 0.35), with kl(new || old) spikes of 0.1-0.17 in one step; PPO's clip stops a
token's push once its ratio has left [0.8, 1.28]. Over seeds 10-19 (2 runs at a time) REINFORCE
gained 0.57 on average, 0.49 at worst, PPO 0.61 and 0.55; PPO's default run over seeds 0-9 gained
0.60 on average, 0.51 at worst (bench/results/demo_seeds.json).
"""

from pipelinerl_jax import presets


def get_config():
    # The values (and why they are what they are) live in the installed package, so a run
    # can be built from Python without this folder: pipelinerl_jax.presets.demo().
    return presets.demo_config()
