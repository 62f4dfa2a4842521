"""The documentation holds: the site builds, the README's links resolve, the code runs.

* `mkdocs build --strict` (mkdocs.yml, docs/) fails on a broken internal link or anchor, a page
  missing from the nav or a nav entry with no page;
* every relative link and image of README.md names a file of the repository;
* each docs page's ```python blocks, concatenated in order, run in one fresh interpreter in
  an empty directory and exit 0; a block whose first line is `# not run: <why>` (it needs a
  downloaded model, or it is an edit of a package module) is left out, and only those;
* the Python API page shows every seam and prints what it says it does.
"""

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xla_env import child_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOT_RUN = "# not run:"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def runnable_blocks(page: Path) -> list[str]:
    return [b for b in python_blocks(page) if not b.startswith(NOT_RUN)]


PAGES = sorted(p.name for p in DOCS.glob("*.md") if runnable_blocks(p))


@functools.cache
def run_page(name: str, workdir: Path) -> subprocess.CompletedProcess:
    """The page's runnable blocks as one script, run once per test process (the API page's
    output is checked by two tests)."""
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / "page.py"
    script.write_text("\n\n".join(runnable_blocks(DOCS / name)))
    # This checkout's package first, whichever one the venv has installed.
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = child_env(PYTHONPATH=os.pathsep.join(path))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.fixture(scope="module")
def pages_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pages")


def test_site_builds_strict(tmp_path):
    missing = [m for m in ("mkdocs", "material") if importlib.util.find_spec(m) is None]
    if missing:
        # `make test-jax011`'s venv installs only the test runners of requirements-test.txt.
        if os.environ.get("PIPELINERL_WITHOUT_TORCH") == "1":
            pytest.skip(f"{', '.join(missing)} not installed in this reduced venv")
        pytest.fail(f"{', '.join(missing)} missing: `make test` installs requirements-test.txt")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "extending" / "index.html").exists()


def test_readme_links_name_files():
    text = (ROOT / "README.md").read_text()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # links inside code do not count
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)
    assert len(targets) > 20, targets
    broken = []
    for target in targets:
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the README itself
        if not (ROOT / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_both_tables_of_pages_name_every_page():
    """The manual's home page and the README's manual section each link every page, so a new
    page cannot land where a newcomer never finds it."""
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    for where, text, prefix in (
        ("docs/index.md", (ROOT / "docs" / "index.md").read_text(), ""),
        ("README.md", (ROOT / "README.md").read_text().split("\n## The manual\n")[1], "docs/"),
    ):
        linked = set(re.findall(rf"\]\({re.escape(prefix)}([a-z_0-9]+\.md)(?:#[^)]*)?\)", text))
        missing = sorted(pages - linked - {"index.md"})
        assert not missing, f"{where} links no page {missing}: add a row or an 'Also' link"


def test_not_run_blocks_say_why():
    """Only blocks marked `# not run: <why>` are left out, and each says why."""
    for page in sorted(DOCS.glob("*.md")):
        for block in python_blocks(page):
            first = block.splitlines()[0] if block.strip() else ""
            if first.startswith(NOT_RUN):
                assert len(first) > len(NOT_RUN) + 5, f"{page.name}: {first!r} gives no reason"
            else:
                assert NOT_RUN not in block, f"{page.name}: the marker must be the first line"


@pytest.mark.parametrize("name", PAGES)
def test_page_code_runs(name, pages_dir):
    done = run_page(name, pages_dir / name.removesuffix(".md"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_pages_with_code_are_the_ones_expected():
    """A page whose blocks all became `# not run:` would silently stop being tested."""
    assert {"api.md", "data.md", "environments.md", "extending.md"} <= set(PAGES), PAGES


def test_api_page_has_an_example_per_seam():
    code = "\n".join(runnable_blocks(DOCS / "api.md"))
    for call in (
        "models.tiny",
        "decoder.jit_forward",
        "steps.state_from_prompts",
        "steps.decode_chunk",
        "register_objective",
        "loss_fn=",
        "optimizer=",
        "pipeline.run",
        "protocol import Sampler",
    ):
        assert call in code, call


def test_api_page_prints_what_it_says(pages_dir):
    done = run_page("api.md", pages_dir / "api")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "(1, 4, 64)" in out  # the forward's logits
    assert "'clip_fraction'" in out and "2 steps, reward" in out
    # Newer versions only, each a version the 3-step run made. The sampler takes the newest
    # at its next chunk boundary, so one published while an older one waits replaces it
    # ([1, 3] on a slow machine); the last may still be in flight when the run ends.
    handed = re.search(r"versions handed over: \[([\d, ]+)\]", out)
    assert handed, out[-2000:]
    versions = [int(v) for v in handed.group(1).split(",")]
    assert versions == sorted(set(versions)) and 1 <= versions[0] and versions[-1] <= 3
