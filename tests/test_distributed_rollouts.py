"""A RemoteSampler over two sampler processes generates what a local PagedSampler does, with
exact per-token versions, and never starts a group below the version it was admitted at.

Three localhost processes under jax.distributed (run by the supervisor): process 0 publishes
weights (WeightServer) and drives a RemoteSampler, processes 1 and 2 pull the weights
(WeightClient) and `serve` their own PagedSampler. Process 0 compares every returned attempt
with a PagedSampler of its own on the same params: greedy tokens equal, logprobs to 1e-6,
for version 0 and, after a publish, for version 1 (requests submitted after the publish carry
min_version 1, so no token of theirs may come from version 0).
"""

import json
import subprocess
import sys
from pathlib import Path

from pipelinerl_jax.distributed import runtime
from pipelinerl_jax.distributed.supervisor import Child, supervise

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = r"""
import functools, json, sys
import jax, jax.numpy as jnp, numpy as np
from pipelinerl_jax.distributed import remote_sampler, runtime
from pipelinerl_jax.distributed.weight_client import WeightClient
from pipelinerl_jax.distributed.weight_server import WeightServer
from pipelinerl_jax.models import decoder
from pipelinerl_jax.sampler.sampler import PagedSampler
from pipelinerl_jax.sampler.config import SamplerConfig
from pipelinerl_jax.sampler.sequence import SamplingParams
from tests.tiny_models import model_config

spec = runtime.ProcessSpec(sys.argv[1], 3, int(sys.argv[2]))
runtime.initialize(spec, heartbeat_s=5)
cfg = model_config(vocab_size=48)
graphdef, params0 = decoder.init(cfg, jax.random.key(0))
SAMPLER = SamplerConfig(num_slots=4, max_seq_len=32, page_size=8, chunk_steps=4,
                        prefill_chunk=16, max_prefill_rows=4)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)

if spec.role == "sampler":
    client = WeightClient(decoder.abstract_init(cfg)[1])
    params, version = client.wait(timeout_s=60)
    sampler = PagedSampler(graphdef, params, SAMPLER, version=version)
    done = remote_sampler.serve(sampler, spec.sampler_index, client.poll)
    print("served", done, flush=True)
    client.close()
    sys.exit(0)

server = WeightServer(pullers=[1, 2])
remote = remote_sampler.RemoteSampler(2, SAMPLER.num_slots, functools.partial(server.publish, copy=False))
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 48, int(n)).tolist() for n in rng.integers(2, 12, 6)]

def drain():
    out = []
    while remote.has_work():
        out += remote.step()
    return sorted(out, key=lambda s: (s.request_id, s.attempt))

def local(params, version):
    ref = PagedSampler(graphdef, params, SAMPLER, version=version)
    return ref.generate(prompts, n=2, params=GREEDY)

def check(got, want, version, offset):
    assert len(got) == len(want) == 2 * len(prompts), (len(got), len(want))
    for g, w in zip(got, want):
        assert g.request_id == w.request_id + offset and g.attempt == w.attempt
        assert g.token_ids == [int(t) for t in w.token_ids], (g.token_ids, w.token_ids)
        # Rows decode in other batch compositions there: the same tolerance as batch vs alone
        # (test_sampler_engine.py); tokens are exact.
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-6)
        assert set(g.versions) == {version}, g.versions

remote.set_params(remote.prepare(params0), 0, prepared=True)
for i, p in enumerate(prompts):
    remote.submit(p, n=2, params=GREEDY, request_id=i)
check(drain(), local(params0, 0), 0, 0)

params1 = jax.tree.map(lambda x: x * 1.5, params0)
remote.set_params(params1, 1)  # not prepared: RemoteSampler copies
for i, p in enumerate(prompts):
    remote.submit(p, n=2, params=GREEDY, request_id=100 + i)
check(drain(), local(params1, 1), 1, 100)
remote.stop()
assert server.wait_idle(30)
print("RESULT", json.dumps({"ok": True, "live": server.live_versions}), flush=True)
server.close()
"""


def test_remote_sampler_over_two_processes_equals_a_local_one(tmp_path):
    coordinator = f"127.0.0.1:{runtime.free_port()}"
    script = tmp_path / "rollouts.py"
    script.write_text(SCRIPT)
    env = (("JAX_PLATFORMS", "cpu"), ("PYTHONPATH", str(ROOT)))
    children = [
        Child(
            runtime.ProcessSpec(coordinator, 3, i).name,
            (sys.executable, str(script), coordinator, str(i)),
            env,
        )
        for i in range(3)
    ]
    lines = []
    outcome = supervise(children, grace_s=2.0, echo=lines.append)
    assert outcome.returncode == 0, "\n".join(lines[-40:])
    result = next(line for line in lines if "RESULT" in line)
    assert json.loads(result.split("RESULT", 1)[1])["ok"]
    assert sum("served" in line for line in lines) == 2


def test_importing_the_library_does_not_start_the_backend():
    """jax.distributed.initialize must run before the XLA backend starts: no module may make
    arrays at import time (sampling.py once did, with a jnp constant)."""
    code = (
        "from jax._src import xla_bridge\n"
        "import pipelinerl_jax.pipeline.runner, pipelinerl_jax.distributed.remote_sampler\n"
        "import pipelinerl_jax.distributed.weights, pipelinerl_jax.evaluate\n"
        "assert not xla_bridge._backends, 'a module started the XLA backend at import'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
