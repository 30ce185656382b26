"""pytest's hooks and fixtures. What the tests share is in `tests/helpers/runs.py`
(`from helpers.runs import train, results, ...`).

Tests of GPU paths carry `@pytest.mark.gpu(N)`, N being the GPUs they need; they run where
that many CUDA devices are visible and are skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.runs import cuda_devices


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Each test leaves this process's environment as it found it. Lightning's cluster
    environments write MASTER_ADDR and MASTER_PORT into os.environ when a test builds a
    Trainer in-process (LSF's did: the hostname); the processes later tests start inherit
    os.environ, and a leaked MASTER_ADDR became their rendezvous address."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`@pytest.mark.gpu(N)`: run with N CUDA devices visible, skipped with the reason else."""
    visible: int | None = None
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.args[0] if marker.args else None
        if isinstance(needed, bool) or not isinstance(needed, int) or needed < 1:
            raise pytest.UsageError(
                f"{item.nodeid}: @pytest.mark.gpu takes the number of GPUs the test needs, "
                f"e.g. @pytest.mark.gpu(1); got {marker.args!r}"
            )
        if visible is None:
            visible = cuda_devices()
        if visible < needed:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs {needed} CUDA GPU(s); {visible} visible on this machine"
                )
            )


_UNGROUPED = pytest.StashKey[str]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup` every `xdist_group` test must carry its group in its id (the
    scheduler reads it there): the SLURM and lab tests share one cluster and one set of
    namespaces, and on two workers at once they failed each other. pytest 9.2 with
    pytest-xdist 3.8 dropped the groups silently; such tests now fail at set-up, saying why,
    instead of running beside each other."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    for item in session.items:
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
            item.stash[_UNGROUPED] = (
                f"{item.nodeid} is marked xdist_group, and under --dist loadgroup its id "
                f"carries no group: pytest-xdist did not apply the groups with this pytest "
                f"({pytest.__version__}), so the tests of one group would run on several "
                "workers at once. Fix: install the versions pyproject.toml admits "
                "(bash scripts/setup.sh dev), or run without -n."
            )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _UNGROUPED in item.stash:
        pytest.fail(item.stash[_UNGROUPED], pytrace=False)


def on_ci() -> bool:
    """CI sets CI=true (so does .ci/run): there every service the tests need is installed."""
    return os.environ.get("CI", "").lower() == "true"


def may_skip_on_ci(item: pytest.Item, reason: str) -> bool:
    """CI has no GPU: tests that need CUDA keep skipping there, with their reason."""
    return item.get_closest_marker("gpu") is not None or "CUDA" in reason


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """With CI=true a skip fails, with its reason: a missing service (SLURM, Open MPI,
    iproute2, namespaces) must not let CI pass with its tests unrun."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and on_ci()) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    if may_skip_on_ci(item, reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"CI=true and this test would be skipped: {reason}. CI must run it: install and start "
        "what it needs (.ci/run does), or run without CI=true to let it skip"
    )


# Test time of the tests not marked slow, summed over this session: what the fast tier
# (`pytest -m "not slow"`) costs, printed at the end of every run (CI runs the whole suite).
_fast_tier = {"tests": 0, "seconds": 0.0}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" in report.keywords:
        return
    _fast_tier["seconds"] += report.duration
    if report.when == "call":
        _fast_tier["tests"] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    if _fast_tier["tests"]:
        terminalreporter.write_line(
            f"fast tier (not marked slow): {_fast_tier['tests']} tests in "
            f"{_fast_tier['seconds']:.0f} s of test time"
        )
