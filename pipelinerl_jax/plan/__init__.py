"""Layout planner: the paper's throughput model, measured profiles, and the split it implies.

- model.py        Appendix A formulas (r_gen, r_train, r_conv, r_pipe, g_max, same-lag search)
- utilisation.py  U(h) / decode-rate curves as data: interpolation, profile load/save
- layout.py       the talk's form: devices, batch, decode latency, train tokens/s -> the plan
- paper.py        the Appendix A.4 case study recomputed (given vs derived numbers)
- measure.py      the U(h) matmul recipe and timing hooks; engine_probe.py times our sampler
                  and trainer
- figures.py      U(h) and throughput-vs-lag PNGs
GPU predictions (`--gpu=h100`), before anyone rents a GPU:
- gpu_specs.py    published peaks of H100/H200 and their XLA target configs
- gpu_compile.py  the decode chunk, train step and publish path compiled for a GPU topology
- roofline.py     FLOPs and HBM bytes of a decode step and a train step; roofline seconds
- gpu_memory.py   per-device memory of each role: analytic, or from compiled records
- gpu_profile.py  the predicted profile (decode latency, train rate) the layout search takes
- gpu_roles.py    the per-role report (fits, step times) the planner and the dry run print
- gpu_plan.py     the planner's --gpu mode; gpu_run.py the same for `launch.py --dry_run --gpu`
CLI: `python -m pipelinerl_jax.plan --help`.
"""
