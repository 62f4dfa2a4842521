"""Layout planner: the paper's throughput model, measured profiles, and the split it implies.

- model.py        Appendix A formulas (r_gen, r_train, r_conv, r_pipe, g_max, same-lag search)
- utilisation.py  U(h) / decode-rate curves as data: interpolation, profile load/save
- layout.py       the talk's form: devices, batch, decode latency, train tokens/s -> the plan
- paper.py        the Appendix A.4 case study recomputed (given vs derived numbers)
- measure.py      the U(h) matmul recipe and timing hooks; engine_probe.py times our sampler
                  and trainer
- figures.py      U(h) and throughput-vs-lag PNGs
CLI: `python -m pipelinerl_jax.plan --help`.
"""
