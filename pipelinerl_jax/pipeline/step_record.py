"""A trained step's host-side record: rewards, lengths, lags, queues, timings and memory.

What the trainer thread logs for step s besides the train step's own device metrics
(Coordinator._log merges the two): computed from the groups and the packed batch on the host,
and from the coordinator's counters (busy fractions, swaps, queue sizes) at that moment.
"""

from __future__ import annotations

import time

import numpy as np

from pipelinerl_jax.pipeline import host_memory
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline.episodes import episode_metrics


def host_record(coord, step, groups, batch, host_stats) -> dict:
    """Step `step`'s record from its `groups`, their packed `batch` and build_batch's
    `host_stats`, with the coordinator's counters as they are now."""
    mask = np.asarray(batch.loss_mask) > 0
    versions = np.asarray(batch.versions)[mask]
    seq = np.asarray(batch.sequence_index)[mask]
    rewards = np.array([r for g in groups for r in g.rewards])
    statuses = [v.status for g in groups for v in g.verdicts]
    lengths = [len(s.token_ids) for g in groups for s in g.samples]
    elapsed = time.perf_counter() - coord.t_start
    record = {
        "step": step,
        "reward/mean": float(rewards.mean()),
        "reward/max": float(rewards.max()),
        "prompts": [g.problem.uid for g in groups],
        "success": float(np.mean([s == "correct" for s in statuses])),
        "completion/len_mean": float(np.mean(lengths)),
        "completion/no_eos_frac": float(
            np.mean([s.finish_reason != "stop" for g in groups for s in g.samples])
        ),
        "samples_per_s": coord.samples_generated / elapsed,
        "trainer/wait_s": coord.trainer_wait_s,
        "trainer/busy_frac": coord.trainer_busy_s / elapsed,
        "sampler/busy_frac": coord.sampler_busy_s / elapsed,
        "sampler/swaps": len(coord.swap_pause_s),
        "sampler/swap_pause_ms": 1e3 * float(np.mean(coord.swap_pause_s or [0.0])),
        "sampler/version": coord.sampler.version,
        "queue/ready_groups": len(coord.board),
        "queue/open_groups": len(coord.open_groups),
        "lag/bound": coord.admission.lag_bound(),
        **{f"batch/{k}": v for k, v in host_stats.items() if np.isscalar(v)},
        **metrics_lib.lag_stats(versions, step, sequence_ids=seq),
    }
    record["memory/peak_rss_gib"] = host_memory.peak_rss_bytes() / 2**30
    if coord.compile_watch is not None:
        record["compile/count"], record["compile/seconds"] = coord.compile_watch.take()
    if coord.diagnostics is not None:
        record.update(coord.diagnostics.record(step, groups, coord.detokenize))
    record.update(episode_metrics([e for g in groups for e in g.episodes]))
    return record
