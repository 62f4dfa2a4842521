"""What a checkpoint keeps of a run's coordinator, and its restoration on resume.

`take(coord)` is JSON-able bookkeeping taken after a step: the step, the data stream's
position, admission's counters, dynamic sampling's drops (pipeline/filtering.py) and every
started-but-untrained group, scored ones with their samples. `restore(coord, snap)` puts it
back before the run starts.
"""

from __future__ import annotations

from pipelinerl_jax.data import prompts as prompts_lib
from pipelinerl_jax.pipeline.groups import Group


def take(coord) -> dict:
    """JSON-able bookkeeping for a checkpoint taken after the current step: the data
    stream position (None: the stream has no get_state, and the checkpoint cannot be
    resumed), the admission counter, and every started-but-untrained group (scored ones
    with their samples; the others as prompts, to be regenerated)."""
    with coord._draw_lock:
        pending = [
            g.to_json(with_samples=len(g.rewards) == coord.cfg.group_size)
            for g in sorted(coord.pending.values(), key=lambda g: g.index)
        ]
        return {
            "step": coord.step,
            "started": coord.admission.started,
            "dropped": coord.admission.dropped,
            "next_index": coord.next_index,
            "dropped_ahead": coord.board.dropped_indices(),
            "filter": None if coord.filter is None else coord.filter.state(),
            "data": (coord.stream.get_state() if prompts_lib.resumable(coord.stream) else None),
            "pending": pending,
        }


def restore(coord, snap: dict) -> None:
    """Inverse of take(), before Coordinator.run(): scored groups go straight to the board.
    A ConfigError, with nothing changed, when the stream's position cannot be restored."""
    step = int(snap["step"])
    if snap["data"] is None:
        raise prompts_lib.no_saved_position(step)
    if not prompts_lib.resumable(coord.stream):
        raise prompts_lib.not_resumable(coord.stream, step)
    coord.step = step
    coord.admission.restore(int(snap["started"]), int(snap.get("dropped", 0)))
    coord.next_index = int(snap.get("next_index", step * coord.admission.groups_per_step))
    if coord.filter is not None and snap.get("filter"):
        coord.filter.restore(snap["filter"])
    for index in snap.get("dropped_ahead", ()):  # walked past by a later step
        coord.board.put(Group(index=int(index), problem=None, prompt_ids=[], dropped=True))
    coord.stream.set_state(snap["data"])
    for item in snap["pending"]:
        group = Group.from_json(item, coord.encode_prompt)
        coord.pending[group.index] = group
        if group.rewards:
            coord.board.put(group)
        else:
            coord.requeue.append(group)
