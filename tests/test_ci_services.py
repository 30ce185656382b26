"""On CI (CI=true) a test that would skip for a missing service fails with the reason, so
that CI cannot pass with SLURM, Open MPI or the lab's tests unrun; tests that need CUDA
keep skipping there (no GPU on CI). Run through this suite's own conftest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
from helpers.runs import TESTS

CASES = """
import pytest


def test_needs_a_service():
    pytest.skip("SLURM is not installed here (start one as root: bash scripts/slurm_local.sh start)")


@pytest.mark.skipif(True, reason="mpirun (openmpi-bin) is not installed")
def test_needs_mpirun():
    pass


@pytest.fixture
def lab():
    pytest.skip("The lab makes network namespaces, which needs root")


def test_needs_the_lab(lab):
    pass


@pytest.mark.gpu(64)
def test_needs_gpus():
    pass


@pytest.mark.skipif(True, reason="torch built without CUDA: it counts no GPU at all")
def test_needs_a_cuda_build():
    pass


@pytest.mark.xfail(reason="a known failure stays an expected failure")
def test_expected_to_fail():
    assert False
"""


def _outcomes(tmp_path: Path, ci: str | None) -> tuple[dict[str, str], str]:
    """Each case's outcome (passed, skipped, xfailed, failed, error) and pytest's output."""
    (tmp_path / "test_cases.py").write_text(CASES)
    report = tmp_path / f"report-{ci}.xml"
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(TESTS)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "conftest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            f"--junitxml={report}",
            "test_cases.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = {}
    for case in ElementTree.parse(report).iter("testcase"):
        kinds = [child for child in case if child.tag in ("skipped", "failure", "error")]
        if not kinds:
            found[case.get("name")] = "passed"
        elif kinds[0].tag == "skipped":
            xfailed = kinds[0].get("type") == "pytest.xfail"
            found[case.get("name")] = "xfailed" if xfailed else "skipped"
        else:
            found[case.get("name")] = "failed" if kinds[0].tag == "failure" else "error"
    return found, proc.stdout


@pytest.mark.slow
def test_a_missing_service_fails_on_ci_and_skips_elsewhere(tmp_path: Path) -> None:
    off_ci, said = _outcomes(tmp_path, None)
    assert off_ci == {
        "test_needs_a_service": "skipped",
        "test_needs_mpirun": "skipped",
        "test_needs_the_lab": "skipped",
        "test_needs_gpus": "skipped",
        "test_needs_a_cuda_build": "skipped",
        "test_expected_to_fail": "xfailed",
    }, said
    on_ci, said = _outcomes(tmp_path, "true")
    assert on_ci == {
        "test_needs_a_service": "failed",
        "test_needs_mpirun": "error",
        "test_needs_the_lab": "error",
        "test_needs_gpus": "skipped",
        "test_needs_a_cuda_build": "skipped",
        "test_expected_to_fail": "xfailed",
    }, said
    # A skip in a test's body fails it, one at setup (a fixture, skipif) is an error: both
    # count against CI, and each says what was missing and what to do.
    assert "CI=true and this test would be skipped: SLURM is not installed here" in said
    assert "mpirun (openmpi-bin) is not installed. CI must run it" in said
    assert "needs 64 CUDA GPU(s)" in said


def test_ci_runs_the_test_command_readme_gives() -> None:
    """README.md's second command is what CI runs, as written: a line of `.ci/run`."""
    root = TESTS.parent
    readme = (root / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in first_block.splitlines() if line.strip()]
    assert len(commands) == 2, first_block
    test_command = commands[1]
    # The whole suite, not a tier of it: no marker or name selection.
    runner, found, options = test_command.partition(" -m pytest")
    assert found and " -m " not in options and " -k " not in options, test_command
    ci_lines = (root / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines, f"{test_command!r} is not a line of .ci/run"


GROUPED_CASES = """
import os

import pytest

pytestmark = pytest.mark.xdist_group("cluster")


@pytest.mark.parametrize("case", range(8))
def test_grouped(case):
    with open("workers.txt", "a") as seen:
        seen.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_an_xdist_group_keeps_its_tests_on_one_worker(tmp_path: Path) -> None:
    """README's test command runs two workers; the SLURM and lab tests share one cluster and
    must run one after another on one of them (xdist_group "cluster"). With pytest 9.2 and
    pytest-xdist 3.8 the groups were silently dropped and those tests failed each other."""
    (tmp_path / "test_grouped.py").write_text(GROUPED_CASES)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider"]
        + ["-n", "2", "--dist", "loadgroup", "--rootdir", str(tmp_path), "test_grouped.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == 8 and len(set(workers)) == 1, workers
