"""pipeline/host_memory.py: this process's peak RSS, and the memory still available."""

import os
import subprocess
import sys

import numpy as np

from pipelinerl_jax.pipeline import host_memory

GiB = 2**30


def test_available_bytes_on_this_machine():
    available = host_memory.available_bytes()
    assert isinstance(available, int) and available > 0


def test_available_bytes_honours_a_smaller_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemAvailable:   4000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert host_memory.available_bytes(meminfo=str(meminfo), cgroup=str(cgroup)) == 4000000 * 1024
    (cgroup / "memory.max").write_text("max\n")
    assert host_memory.available_bytes(meminfo=str(meminfo), cgroup=str(cgroup)) == 4000000 * 1024
    (cgroup / "memory.max").write_text(f"{2 * GiB}\n")
    (cgroup / "memory.current").write_text(f"{GiB // 2}\n")
    assert host_memory.available_bytes(meminfo=str(meminfo), cgroup=str(cgroup)) == GiB * 3 // 2
    assert (
        host_memory.available_bytes(meminfo=str(tmp_path / "none"), cgroup=str(tmp_path / "none"))
        is None
    )


def test_peak_rss_counts_a_touched_allocation():
    """The peak is at least what is resident now (the kernel's high-water mark trails the
    resident count by a few pages), which includes a freshly written array."""
    block = np.random.default_rng(0).standard_normal(32 * 2**20 // 8)  # 32 MiB, every page set
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert host_memory.peak_rss_bytes() >= 0.98 * resident and resident >= block.nbytes


def test_peak_rss_of_a_child_is_its_own_not_its_parents():
    """A benchmark measures each side's peak in a child process: the child must not report
    the high-water mark of the large process that started it (getrusage's ru_maxrss does)."""
    block = np.ones(512 * 2**20 // 8)  # 512 MiB resident in this process
    code = "from pipelinerl_jax.pipeline import host_memory; print(host_memory.peak_rss_bytes())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    child_peak = int(out.stdout.strip())
    assert child_peak < host_memory.peak_rss_bytes() - block.nbytes // 2, (child_peak, block.nbytes)
