"""A process's cores are its affinity lowered to its cgroup's cpu quota (a container's CPU
limit, a lab node's share): threads and loader workers follow the quota, not the machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddp_template.launch.topology import cpu_quota_cores

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
PRINT_CORES = (
    "from ddp_template.launch.topology import available_cores, cpu_quota_cores;"
    "print(available_cores(), cpu_quota_cores())"
)


def _v1_group(root: Path, path: str, quota_us: int, period_us: int = 100_000) -> None:
    folder = root / "cpu" / path
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (folder / "cpu.cfs_period_us").write_text(f"{period_us}\n")


def test_the_tightest_quota_of_the_group_and_its_ancestors_counts(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("3:cpuset:/\n2:cpu:/job/step\n1:name=systemd:/job\nnot a cgroup line\n")
    _v1_group(tmp_path, "", -1)
    _v1_group(tmp_path, "job", 150_000)
    _v1_group(tmp_path, "job/step", -1)
    assert cpu_quota_cores(proc, tmp_path) == pytest.approx(1.5)
    _v1_group(tmp_path, "job/step", 40_000, 50_000)
    assert cpu_quota_cores(proc, tmp_path) == pytest.approx(0.8)


def test_cgroup_v2_and_no_quota(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/pod/container\n")
    (tmp_path / "pod" / "container").mkdir(parents=True)
    (tmp_path / "pod" / "container" / "cpu.max").write_text("max 100000\n")
    assert cpu_quota_cores(proc, tmp_path) is None
    (tmp_path / "pod" / "cpu.max").write_text("400000 100000\n")
    assert cpu_quota_cores(proc, tmp_path) == pytest.approx(4.0)
    # No cgroup file system at all (e.g. a /sys without it): no quota, not an error.
    assert cpu_quota_cores(tmp_path / "missing", tmp_path) is None


def test_a_process_under_a_real_quota_counts_one_core(tmp_path: Path) -> None:
    """On this machine's cgroup v1 (as root): 0.5 of a core is one thread, whatever the
    affinity says."""
    group = CPU_CGROUPS / f"quota-test-{tmp_path.name[-20:]}"
    group.mkdir()
    try:
        (group / "cpu.cfs_quota_us").write_text("50000")
        enter = f'echo $$ > {group}/cgroup.procs && exec "$@"'
        out = subprocess.run(
            ["sh", "-c", enter, "sh", sys.executable, "-c", PRINT_CORES],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    finally:
        group.rmdir()
    assert out == ["1", "0.5"]
