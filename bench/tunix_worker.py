"""Tunix's side of bench/bench_vs_tunix.py: its GRPOLearner trains SmolLM2-135M-Instruct on CPU.

    .venv-tunix/bin/python bench/tunix_worker.py --data=prompts.json --steps=6 --out=tunix.json

Runs under .venv-tunix (`make tunix-venv`: google-tunix 0.1.7 needs safetensors < 0.8, our
venv pins 0.8.0), never under .venv. bench/bench_vs_tunix.py starts it; it is a data collector
only: the parent's own worker (our venv) writes --data, the stream's prompts rendered by our
pipeline (chat text and token ids) with the run's settings and our model's logprobs of the
first prompt; this script trains `--steps` GRPO steps on them and writes the raw per-step
record to --out (step end times, seconds in the rollout and in the train step, sampled
rewards, completion tokens, prompt uids, peak RSS); the parent turns it into the figures.
Rewards are computed here, inside Tunix's reward callback, by our own pure-Python reward code
(pipelinerl_jax.rewards: math-verify, pinned to the same 0.9.0 in both venvs), imported from
the repository without installing our package.

What this script changes in Tunix, and why (--out measures the first two):
  * rope_theta: tunix/models/llama3/model.py calls apply_rope() without the config's
    rope_theta, so every Llama runs at the default 1e6; SmolLM2's is 1e5. Patched (the module's
    apply_rope bound to the config's theta); the check below measures both.
  * pad token: SmolLM2's pad token is its EOS, <|im_end|>, and Tunix masks every position whose
    token equals pad_id (sampler prefill, rl/common.process_ids), so each <|im_end|> inside the
    chat prompt would vanish from the model's view. Pad is set to <|endoftext|> (id 0, in no
    prompt); EOS stays <|im_end|>, our sampler's only stop token.
  * mesh: a (1, 1) ("fsdp", "tp") Mesh with Auto axes: jax.make_mesh's default Explicit axes
    make Tunix's embedding lookup raise ShardingTypeError on jax 0.10.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import resource
import sys
import time
from pathlib import Path

T_LAUNCH = time.perf_counter()  # before the heavy imports: launch-to-first-step counts them

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from tunix.models.llama3 import model as llama  # noqa: E402
from tunix.models.llama3 import params as llama_params  # noqa: E402
from tunix.rl import rl_cluster as rlc  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Appended, not prepended: the repository's folders (models/, bench/) must not shadow packages.
sys.path.append(str(ROOT))
from pipelinerl_jax.data.formats import Problem  # noqa: E402  (pure Python)
from pipelinerl_jax.rewards.math import math_reward  # noqa: E402  (math-verify)
from pipelinerl_jax.rewards.tables import get_reward_table  # noqa: E402

ORIGINAL_APPLY_ROPE = llama.apply_rope
PAD_TOKEN = "<|endoftext|>"


def model_config(hf: dict) -> llama.ModelConfig:
    """Tunix's Llama3 config for a Hugging Face Llama config.json (no rope scaling, no biases)."""
    assert hf["model_type"] == "llama" and not hf.get("rope_scaling"), hf
    assert not hf.get("attention_bias") and not hf.get("mlp_bias"), hf
    return llama.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]),
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(hf["rope_theta"]),
        norm_eps=hf["rms_norm_eps"],
        weight_tying=hf["tie_word_embeddings"],
    )


def use_rope_theta(theta: float | None) -> None:
    """Attention.block looks apply_rope up in its module at call time: bind theta there (None:
    Tunix's own, which ignores the config)."""
    llama.apply_rope = (
        ORIGINAL_APPLY_ROPE
        if theta is None
        else functools.partial(ORIGINAL_APPLY_ROPE, rope_theta=theta)
    )


def prompt_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[t] | ids[:t]) for t >= 1 under Tunix's model, one unpadded row, eagerly."""
    tokens = jnp.asarray(ids, jnp.int32)[None]
    length = tokens.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))[None]
    logits, _ = model(tokens, jnp.arange(length)[None], None, causal)
    logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
    return np.asarray(jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0])


def check_model(model, ids: list[int], reference: list[float], theta: float) -> dict:
    """Max |logprob difference| to our model on the first prompt, with Tunix's rope and with
    the config's: the two sides must train the same model."""
    ref = np.asarray(reference)
    use_rope_theta(None)
    unpatched = float(np.abs(prompt_logprobs(model, ids) - ref).max())
    use_rope_theta(theta)
    patched = float(np.abs(prompt_logprobs(model, ids) - ref).max())
    assert patched < 1e-3, f"Tunix's model differs from ours by {patched} nats"
    return {"max_abs_logprob_diff": patched, "max_abs_logprob_diff_unpatched_rope": unpatched}


def cpu_mesh() -> jax.sharding.Mesh:
    """One device on Tunix's ("fsdp", "tp") axes, Auto-typed (see the module docstring)."""
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


def build_cluster(model, tok, mesh, s: dict, steps: int, train_micro_batch: int) -> rlc.RLCluster:
    """`mesh` for every role (actor and rollout then share one model: no weight sync).
    `train_micro_batch`: prompts per gradient-accumulation micro-batch (0: Tunix's default,
    the whole batch in one train step)."""
    prompts_per_step = s["batch"] // s["group"]
    batching = {}
    if train_micro_batch:
        batching = dict(
            mini_batch_size=prompts_per_step,
            train_micro_batch_size=train_micro_batch,
            # Rollout and logprob passes keep the whole batch, as in Tunix's default.
            rollout_micro_batch_size=prompts_per_step,
            compute_logps_micro_batch_size=prompts_per_step,
        )
    optimizer = optax.chain(
        optax.clip_by_global_norm(s["grad_clip_norm"]),
        optax.adamw(s["learning_rate"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0),
    )
    config = rlc.ClusterConfig(
        role_to_mesh={role: mesh for role in (rlc.Role.ACTOR, rlc.Role.ROLLOUT)},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rlc.RLTrainingConfig(
            actor_optimizer=optimizer,
            eval_every_n_steps=10**9,  # no evaluation
            max_steps=steps,
            **batching,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=s["max_new_tokens"],
            # Prompts are left-padded to this, the KV cache holds prompt + completion: both
            # fixed, so the sampler and the train step compile once.
            max_prompt_length=s["max_prompt_tokens"],
            kv_cache_size=s["max_prompt_tokens"] + s["max_new_tokens"],
            temperature=s["temperature"],
            top_p=1.0,  # top_p 1 and no top_k: plain categorical sampling (None: greedy)
            top_k=None,
            eos_tokens=s["eos_token_ids"],
        ),
    )
    return rlc.RLCluster(actor=model, tokenizer=tok, cluster_config=config)


def record_steps(cluster, record: dict, updates_per_step: int) -> None:
    """Wraps the cluster's rollout and actor update to time each step and keep the sampled
    token counts (Tunix's reward callback gets only the decoded text). Tunix calls
    update_actor once per micro-batch: a step ends with its `updates_per_step`-th call, once
    the new weights are computed (the next rollout waits for them anyway: one mesh, no
    asynchronous rollout)."""
    generate, update_actor = cluster.generate, cluster.update_actor
    calls = []

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        record["generate_s"].append(time.perf_counter() - start)
        record["last_tokens"] = [len(t) for t in out.tokens]
        return out

    def timed_update(*args, **kwargs):
        start = time.perf_counter()
        out = update_actor(*args, **kwargs)
        step_done = (len(calls) + 1) % updates_per_step == 0
        if step_done:
            jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        calls.append(time.perf_counter() - start)
        if step_done:
            record["step_end_s"].append(time.perf_counter() - T_LAUNCH)
            # The step's time in the train step (the first step's includes its compile).
            record["update_s"].append(sum(calls[-updates_per_step:]))
        return out

    cluster.generate, cluster.update_actor = timed_generate, timed_update


def make_reward(s: dict, record: dict):
    """Our reward (math-verify on the last \\boxed{} through the run's reward table), with the
    token counts of the rollout it scores."""
    table = get_reward_table(s["reward_table"], **s["reward_table_options"])
    max_new = s["max_new_tokens"]

    def reward(prompts, completions, uid, question, answer, source, **_):
        scores, tokens = [], 0
        for text, n, u, q, a, src in zip(
            completions, record["last_tokens"], uid, question, answer, source
        ):
            # Tunix returns completions up to, not including, the first EOS: finished when
            # one came before the cap; the EOS was sampled, so it counts as a token.
            finished = n < max_new
            verdict = math_reward(
                text, Problem(uid=str(u), question=str(q), answer=str(a), source=str(src))
            )
            parts = table.compute(
                verdict, num_tokens=n + finished, max_tokens=max_new, finished=finished
            )
            scores.append(parts.reward)
            tokens += n + finished
        record["rewards"].append(float(np.mean(scores)))
        record["completion_tokens"].append(tokens)
        record["prompts"] += [str(u) for u in uid[:: s["group"]]]
        return scores

    return reward


def batches(rows: list[dict], steps: int) -> list[dict]:
    """Tunix's training input: one dict of arrays per step (it repeats each prompt `group`
    times itself); the keys besides "prompts" reach the reward callback."""
    per_step = len(rows) // steps
    assert per_step * steps == len(rows)
    fields = {"prompts": "text", **{k: k for k in ("uid", "question", "answer", "source")}}
    return [
        {k: np.array([r[f] for r in rows[i : i + per_step]]) for k, f in fields.items()}
        for i in range(0, len(rows), per_step)
    ]


def versions() -> dict:
    names = ("google-tunix", "jax", "jaxlib", "flax", "qwix", "optax", "math-verify")
    return {n: importlib.metadata.version(n) for n in names}


def load_policy(model_dir: Path):
    """(HF config, mesh, Tunix's Llama3 with our f32 weights, tokenizer with pad fixed)."""
    hf = json.loads((model_dir / "config.json").read_text())
    mesh = cpu_mesh()
    model = llama_params.create_model_from_safe_tensors(
        str(model_dir), model_config(hf), mesh, dtype=jnp.float32
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = PAD_TOKEN
    return hf, mesh, model, tok


def train(cluster, s: dict, rows: list[dict], steps: int, micro: int) -> dict:
    """`steps` GRPO steps of Tunix's learner; the per-step record."""
    per_step = s["prompts_per_step"]
    assert per_step % micro == 0, f"--train_micro_batch must divide {per_step} prompts"
    keys = ("step_end_s", "generate_s", "update_s", "rewards", "completion_tokens", "prompts")
    record = {k: [] for k in keys}
    record_steps(cluster, record, per_step // micro)
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=s["group"],
            num_iterations=1,  # strictly on-policy: one update per batch
            beta=0.0,  # no KL term, no reference model
            epsilon=s["epsilon"],
            loss_agg_mode="sequence-mean-token-mean",  # Tunix's default, spelled out
        ),
        reward_fns=make_reward(s, record),
    )
    learner.train(batches(rows, steps))
    del record["last_tokens"]
    return record


def main() -> None:
    global T_LAUNCH
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="JSON from bench_vs_tunix.py --worker=prepare")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--train_micro_batch", type=int, default=0, help="0: Tunix's default")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    data = json.loads(Path(args.data).read_text())
    s = data["settings"]
    rows = data["rows"][: args.steps * s["prompts_per_step"]]
    hf, mesh, model, tok = load_policy(ROOT / s["model_dir"])
    assert tok.pad_token_id not in s["eos_token_ids"]

    # The check is not Tunix's start-up: its time is taken off the launch clock.
    start = time.perf_counter()
    check = check_model(model, rows[0]["ids"], data["reference_logprobs"], hf["rope_theta"])
    check["seconds"] = time.perf_counter() - start
    T_LAUNCH += check["seconds"]

    cluster = build_cluster(model, tok, mesh, s, args.steps, args.train_micro_batch)
    # Tunix renders nothing itself here: it tokenizes our chat text (adding a BOS the text
    # already starts with, then dropping the duplicate); it must get our ids exactly.
    for r in rows:
        assert cluster.rollout._sampler.tokenize(r["text"]).tolist() == r["ids"], r["uid"]
    record = train(cluster, s, rows, args.steps, args.train_micro_batch or s["prompts_per_step"])
    record["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    record["model_check"] = check
    # How many tokens of a prompt Tunix would have masked with the model's own pad (= EOS).
    own_pad = int(hf["pad_token_id"])
    record["own_pad_tokens_per_prompt"] = sum(r["ids"].count(own_pad) for r in rows) / len(rows)
    record["train_micro_batch"] = args.train_micro_batch
    record["versions"] = versions()
    Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
