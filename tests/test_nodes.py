"""Processes started by torchrun or srun, and nodes: the world size is what was started or
the job refuses to start; nodes without a shared disk stop before training; max_restarts
is refused where nothing restarts. The launcher tests run real processes; the checks of the
launcher's environment run in-process with the variables torchrun and srun set."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import FAST, ROOT, compose_train, free_port, results, start

from ddp_template.config.checks import check_config
from ddp_template.errors import ConfigError

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TRAIN = str(ROOT / "train.py")


# --- torchrun ------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_without_devices_trains_one_job_of_two_ranks(tmp_path: Path) -> None:
    proc = start([TORCHRUN, "--standalone", "--nproc_per_node=2", TRAIN, *FAST], cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    written = list(tmp_path.glob("outputs/**/results.json"))
    assert len(written) == 1 and len(list(tmp_path.glob("outputs/*/*"))) == 1
    record = results(written[0].parent)
    assert record["world_size"] == 2 and record["devices_per_node"] == 2
    assert record["config"]["devices"] == 2 and record["config"]["num_nodes"] == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "override,message",
    [
        (
            "devices=3",
            "devices=3 is not valid: torchrun started 2 processes on this node "
            "(--nproc_per_node=2) and each process is one rank, so devices must be 2",
        ),
        ("max_restarts=1", "max_restarts=1 is not valid: 0 under torchrun"),
    ],
    ids=["devices=3", "max_restarts=1"],
)
def test_torchrun_refuses_on_every_rank_before_training(
    tmp_path: Path, override: str, message: str
) -> None:
    proc = start(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", TRAIN, "strategy=ddp", override, *FAST],
        cwd=tmp_path,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    # A rank prints the one-paragraph message and exits 2 (torchrun reports the exit code).
    # torchrun then stops the other rank, which may not have reached the check yet on a
    # loaded machine: it prints the same message, or nothing; it never trains.
    assert 1 <= err.count(f"error: {message}") <= 2, err[-3000:]
    assert "Fix:" in err and "exitcode  : 2" in err
    assert "Traceback" not in out
    assert not list(tmp_path.glob("outputs/**/*.ckpt"))
    assert not list(tmp_path.glob("outputs/**/results.json"))


# --- srun ----------------------------------------------------------------------------


def _srun_task_env(rank: int, port: int) -> dict[str, str]:
    """What srun gives each task of `srun --nodes=1 --ntasks-per-node=2`."""
    return {
        "SLURM_JOB_ID": "5151",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NAME": "train",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@pytest.mark.slow
def test_srun_tasks_take_devices_from_the_environment(tmp_path: Path) -> None:
    port = free_port()
    tasks = [
        start([sys.executable, TRAIN, "strategy=ddp", *FAST], tmp_path, _srun_task_env(r, port))
        for r in (0, 1)
    ]
    outputs = [t.communicate(timeout=300) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], [o[1][-2000:] for o in outputs]
    record = results(tmp_path / "outputs" / "slurm" / "5151.0")
    assert record["world_size"] == 2 and record["devices_per_node"] == 2
    assert record["config"]["devices"] == 2


# --- the checks of the launcher's environment (in-process) ----------------------------

TORCHRUN_TWO_NODES = {
    "TORCHELASTIC_RUN_ID": "job",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "2",
    "WORLD_SIZE": "4",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}
SRUN_TWO_NODES = {
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_NNODES": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "127.0.0.1",
}


def _launched_by(monkeypatch, env: dict[str, str]) -> None:
    for name in [*TORCHRUN_TWO_NODES, *SRUN_TWO_NODES]:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("env", [TORCHRUN_TWO_NODES, SRUN_TWO_NODES], ids=["torchrun", "srun"])
def test_devices_and_nodes_come_from_the_launcher(monkeypatch, env: dict[str, str]) -> None:
    _launched_by(monkeypatch, env)
    cfg = compose_train("strategy=ddp")
    check_config(cfg)
    assert (cfg.devices, cfg.num_nodes) == (2, 2)
    explicit = compose_train("strategy=ddp", "devices=2", "num_nodes=2")
    check_config(explicit)
    assert (explicit.devices, explicit.num_nodes) == (2, 2)


@pytest.mark.parametrize("env", [TORCHRUN_TWO_NODES, SRUN_TWO_NODES], ids=["torchrun", "srun"])
@pytest.mark.parametrize("override,key", [("devices=1", "devices"), ("num_nodes=1", "num_nodes")])
def test_a_number_that_differs_from_the_launcher_is_refused(
    monkeypatch, env: dict[str, str], override: str, key: str
) -> None:
    _launched_by(monkeypatch, env)
    with pytest.raises(ConfigError) as err:
        check_config(compose_train("strategy=ddp", override))
    assert err.value.key == key
    assert f"{override} is not valid" in str(err.value) and "must be 2" in str(err.value)


def test_srun_without_tasks_per_node_is_refused(monkeypatch) -> None:
    _launched_by(
        monkeypatch, {k: v for k, v in SRUN_TWO_NODES.items() if k != "SLURM_NTASKS_PER_NODE"}
    )
    with pytest.raises(ConfigError, match="--ntasks-per-node"):
        check_config(compose_train("strategy=ddp"))


def test_without_a_launcher_auto_is_one_node_and_the_visible_devices(monkeypatch) -> None:
    _launched_by(monkeypatch, {})
    cfg = compose_train("accelerator=cpu")
    check_config(cfg)
    assert (cfg.devices, cfg.num_nodes) == (1, 1)


@pytest.mark.parametrize(
    "overrides,env,names",
    [
        (["devices=1"], {}, "one process"),
        (["strategy=ddp_spawn", "devices=2"], {}, "strategy=ddp"),
        (["strategy=ddp"], TORCHRUN_TWO_NODES, "--max-restarts=1"),
        (["strategy=ddp"], SRUN_TWO_NODES, "requeue"),
    ],
    ids=["one process", "ddp_spawn", "torchrun", "srun"],
)
def test_max_restarts_where_nothing_restarts_is_refused(
    monkeypatch, overrides: list[str], env: dict[str, str], names: str
) -> None:
    _launched_by(monkeypatch, env)
    with pytest.raises(ConfigError) as err:
        check_config(compose_train(*overrides, "max_restarts=1"))
    assert err.value.key == "max_restarts" and names in str(err.value)
    check_config(compose_train(*overrides, "max_restarts=0"))


# Nodes without a shared file system, and several nodes over a network: tests/test_netlab.py.
