"""A seconds-scale smoke configuration: the default task on a 2-layer d=32 decoder.

    python launch.py --config=configs/tiny.py --workdir=/tmp/prl_tiny

Used by the test suite (resume, shutdown) and handy to check an installation end to end. It
does not learn much in its few steps; configs/default.py is the run that visibly learns.
"""

from configs import default


def get_config():
    c = default.get_config()
    c.steps = 8
    c.group_size = 4
    c.batch_size = 16
    c.log_every = 1
    c.batch.filter_zero_std_groups = False
    c.generation.max_new_tokens = 12
    c.sampler.num_slots = 16
    c.sampler.max_seq_len = 24
    c.sampler.chunk_steps = 2
    c.model.init.update(
        hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16
    )
    return c
