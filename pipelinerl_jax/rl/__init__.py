"""The learning side's pure pieces: batches, advantages, token weights, logprobs, objectives.

- config.py      BatchConfig and LossConfig (frozen; what the jitted step compiles against)
- batch.py       ScoredSample -> packed TrainBatch rows (segments, shared prompts), on the host
- advantages.py  group-relative advantages from one step's rewards
- weights.py     token weights: how per-token losses add up to the step's loss
- logprobs.py    target-token logprobs and entropy in bounded f32 memory (custom VJPs)
- objectives.py  the registry of per-token objectives (tis_reinforce, ppo, gspo, yours)
- losses.py      an objective plus KL and entropy terms and its metrics, fused or not
"""
