"""The real config's train step with the layers' gradients added into the accumulator in place,
against the summed form (the micro-batch's whole gradient, then added): time and memory.

    make real-model
    python bench/bench_accumulation.py              # 6 alternating rounds
    python bench/bench_accumulation.py --rounds=3

configs/smollm2_math.py trains 16 one-row micro-batches of 448 tokens a step, the empty rows
skipped. Both forms run its step (SmolLM2-135M-Instruct, f32, remat keeping the matmuls) on
the same batch: 4 groups of 4 attempts sharing their prompt, as a pipeline step packs them.
Reported per form: XLA's buffer assignment of the compiled step (temporaries,
`compiled.memory_analysis()`), the first step's loss and gradient norm (the same values are
expected), and the median seconds a step over alternating rounds (`common.alternating_medians`).
`trainer.accumulate_in_place` picks the form (models/accumulating_scan.py).

Writes bench/results/accumulation.json.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

MODEL_DIR = common.REAL_MODEL_DIR
FORMS = {"in_place": True, "summed": False}
GiB = 2**30


def _batch(cfg, vocab: int):
    """4 groups x 4 attempts: a 130-token prompt each group, 17-144 completion tokens."""
    import numpy as np

    from pipelinerl_jax.rl.batch import ScoredSample, build_batch

    rng = np.random.default_rng(0)
    samples = []
    for group in range(4):
        prompt = rng.integers(0, vocab, 130).tolist()
        for _ in range(4):
            n = int(rng.integers(17, 145))
            samples.append(
                ScoredSample(
                    prompt,
                    rng.integers(0, vocab, n).tolist(),
                    (-rng.random(n) * 4 - 1).tolist(),
                    [0] * n,
                    float(rng.random() < 0.5),
                    group,
                )
            )
    return build_batch(samples, cfg.batch)[0]


def main() -> int:
    parser = common.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed steps per form")
    args = parser.parse_args()
    if args.rounds < 1:
        print(f"--rounds={args.rounds}: give at least 1", file=sys.stderr)
        return 2
    common.require_model(MODEL_DIR)
    load = common.warn_if_busy()

    import jax

    from pipelinerl_jax import presets
    from pipelinerl_jax.models import decoder, hf_io
    from pipelinerl_jax.pipeline import components, config_dict
    from pipelinerl_jax.train import trainer as tr

    cfg = config_dict.from_config_dict(presets.smollm2_math_config())
    model_cfg = components.model_config(cfg)
    _, _, params = hf_io.load_hf(
        MODEL_DIR,
        param_dtype=model_cfg.param_dtype,
        compute_dtype=model_cfg.compute_dtype,
        remat=model_cfg.remat,
        remat_policy=model_cfg.remat_policy,
    )
    graphdef, abstract = decoder.abstract_init(model_cfg)
    batch = _batch(cfg, model_cfg.vocab_size)
    rows_used = int((batch.loss_mask.sum(axis=1) > 0).sum())
    steps, rows = {}, []
    for form, in_place in FORMS.items():
        tcfg = dataclasses.replace(cfg.trainer, accumulate_in_place=in_place)
        trainer = tr.Trainer(tcfg, graphdef, abstract, tr.trainer_mesh())
        box = {"state": trainer.init_state(params)}
        dev_batch = trainer.put_batch(batch)
        memory = trainer.lower(box["state"], dev_batch).compile().memory_analysis()
        box["state"], metrics = trainer.train_step(box["state"], dev_batch)
        first = jax.device_get(metrics)

        def step(trainer=trainer, box=box, dev_batch=dev_batch):
            box["state"], m = trainer.train_step(box["state"], dev_batch)
            jax.block_until_ready(m)

        steps[form] = step
        rows.append(
            dict(
                form=form,
                temp_gib=memory.temp_size_in_bytes / GiB,
                first_loss=float(first["loss"]),
                first_grad_norm=float(first["grad_norm"]),
            )
        )
    timed = common.alternating_medians(steps, repeats=args.rounds, warmup=0)
    for row in rows:
        row["median_s"], row["times"] = timed[row["form"]]
    ours, theirs = rows
    payload = dict(
        benchmark="accumulation",
        config="configs/smollm2_math.py",
        micro_batches=cfg.trainer.micro_batches,
        rows_used=rows_used,
        rows_per_step=batch.tokens.shape[0],
        seq_len=batch.tokens.shape[1],
        load=load,
        rows=rows,
        same_first_step=ours["first_loss"] == theirs["first_loss"]
        and abs(ours["first_grad_norm"] - theirs["first_grad_norm"])
        <= 1e-5 * theirs["first_grad_norm"],
    )
    common.print_table(rows, ["form", "temp_gib", "median_s", "first_loss", "first_grad_norm"])
    common.write_result("accumulation", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
