"""The README's own-environment example runs as a newcomer would run it: the README's
`my_envs.py` block saved as a file, then launch.py with `--config.env.name=my_envs:...` and
the flags the README gives (fewer steps), the environment answered in worker processes."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> tuple[str, list[str]]:
    """(the my_envs.py block, the launch command's flags) from the README."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(# my_envs\.py.*?)```", text, re.S)
    command = re.search(r"```bash\n(PYTHONPATH=\. python launch\.py .*?)```", text, re.S)
    assert code and command, "README.md lost its my_envs.py example or its command"
    flags = command.group(1).replace("\\\n", " ").split()[3:]
    return code.group(1), flags


def test_the_readme_environment_trains(tmp_path):
    code, flags = readme_example()
    (tmp_path / "my_envs.py").write_text(code)
    flags = [f for f in flags if not f.startswith(("--workdir", "--config.steps"))]
    workdir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [
            sys.executable,
            "launch.py",
            *flags,
            "--config.steps=4",
            "--config.eval_every=4",
            "--config.eval.num_problems=8",
            f"--workdir={workdir}",
        ],
        cwd=ROOT,  # the README's command runs in the repository, with my_envs.py on the path
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 4
    assert all(r["episode/error_frac"] == 0 and r["episode/turns_mean"] >= 1 for r in train)
    assert max(r["episode/turns_max"] for r in train) > 1  # some answer was tried again
