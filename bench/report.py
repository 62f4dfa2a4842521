"""Renders the tables of measured figures from bench/results/*.json.

    python bench/report.py            # print the tables
    python bench/report.py --write    # also rewrite them between their markers:
                                      #   README.md: the peer ratios, the headline table
                                      #     and the GPU summary
                                      #   docs/benchmarks.md: the peer ratios (bench/
                                      #     peer_table.py) and every measured figure
                                      #   docs/gpu.md: the GPU summary
                                      #   docs/gpu_compile.md: every compiled GPU program

Only full (non --quick) results are used; a benchmark with no result yet gets a row saying so,
never a number. Each row names the command that produced it and the machine load it ran under.
The README's headline rows are rendered by the same functions as the full table, so the two
never disagree. Files are written all or nothing: if one lacks its markers, none is written.
The rows are rendered by bench/reports/ (one module a kind of row) and bench/peer_table.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.*, when run as `python bench/report.py`

from bench import peer_table  # noqa: E402
from bench.reports import results  # noqa: E402
from bench.reports.gpu_tables import gpu_summary, gpu_table  # noqa: E402
from bench.reports.tables import headline, table  # noqa: E402

BEGIN, END = "<!-- bench/report.py: begin -->", "<!-- bench/report.py: end -->"
GPU_BEGIN, GPU_END = "<!-- bench/report.py gpu: begin -->", "<!-- bench/report.py gpu: end -->"
HEADLINE_BEGIN = "<!-- bench/report.py headline: begin -->"
HEADLINE_END = "<!-- bench/report.py headline: end -->"
PEERS_BEGIN = "<!-- bench/report.py peers: begin -->"
PEERS_END = "<!-- bench/report.py peers: end -->"


def _replace(content: str, begin: str, end: str, text: str) -> str | None:
    if begin not in content or end not in content:
        return None
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{text}\n{end}{tail}"


def targets() -> tuple:
    """(file, ((begin, end, text), ...)) for every generated table."""
    return (
        (
            ROOT / "README.md",
            (
                (PEERS_BEGIN, PEERS_END, peer_table.render(results.RESULTS)),
                (HEADLINE_BEGIN, HEADLINE_END, headline()),
                (GPU_BEGIN, GPU_END, gpu_summary()),
            ),
        ),
        (
            ROOT / "docs" / "benchmarks.md",
            ((PEERS_BEGIN, PEERS_END, peer_table.render(results.RESULTS)), (BEGIN, END, table())),
        ),
        (ROOT / "docs" / "gpu.md", ((GPU_BEGIN, GPU_END, gpu_summary()),)),
        (ROOT / "docs" / "gpu_compile.md", ((GPU_BEGIN, GPU_END, gpu_table()),)),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write",
        "--readme",
        dest="write",
        action="store_true",
        help="rewrite the tables between their markers in README.md, docs/benchmarks.md, "
        "docs/gpu.md and docs/gpu_compile.md (--readme: the old name)",
    )
    args = parser.parse_args()
    print(table())
    print()
    print(gpu_table())
    if args.write:
        updated = []  # every file checked before any is written
        for path, blocks in targets():
            content = path.read_text() if path.exists() else ""
            for begin, end, body in blocks:
                replaced = _replace(content, begin, end, body)
                if replaced is None:
                    print(
                        f"{path.relative_to(ROOT)} lacks the markers {begin} ... {end}: add "
                        "them where the table goes",
                        file=sys.stderr,
                    )
                    return 2
                content = replaced
            updated.append((path, content))
        for path, content in updated:
            path.write_text(content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
