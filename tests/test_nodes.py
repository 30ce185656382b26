"""Processes started by torchrun or srun, and nodes: the world size is what was started or
the job refuses to start; nodes without a shared disk stop before training; max_restarts
is refused where nothing restarts. The launcher tests run real processes; the checks of the
launcher's environment run in-process with the variables torchrun and srun set."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.runs import FAST, ROOT, compose_train, free_port, results, start

from ddp_template.config.checks import resolve_and_check
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
    resolve_and_check(cfg)
    assert (cfg.devices, cfg.num_nodes) == (2, 2)
    explicit = compose_train("strategy=ddp", "devices=2", "num_nodes=2")
    resolve_and_check(explicit)
    assert (explicit.devices, explicit.num_nodes) == (2, 2)


@pytest.mark.parametrize("env", [TORCHRUN_TWO_NODES, SRUN_TWO_NODES], ids=["torchrun", "srun"])
@pytest.mark.parametrize("override,key", [("devices=1", "devices"), ("num_nodes=1", "num_nodes")])
def test_a_number_that_differs_from_the_launcher_is_refused(
    monkeypatch, env: dict[str, str], override: str, key: str
) -> None:
    _launched_by(monkeypatch, env)
    with pytest.raises(ConfigError) as err:
        resolve_and_check(compose_train("strategy=ddp", override))
    assert err.value.key == key
    assert f"{override} is not valid" in str(err.value) and "must be 2" in str(err.value)


def test_srun_without_tasks_per_node_is_refused(monkeypatch) -> None:
    _launched_by(
        monkeypatch, {k: v for k, v in SRUN_TWO_NODES.items() if k != "SLURM_NTASKS_PER_NODE"}
    )
    with pytest.raises(ConfigError, match="--ntasks-per-node"):
        resolve_and_check(compose_train("strategy=ddp"))


def test_without_a_launcher_auto_is_one_node_and_the_visible_devices(monkeypatch) -> None:
    _launched_by(monkeypatch, {})
    cfg = compose_train("accelerator=cpu")
    resolve_and_check(cfg)
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
        resolve_and_check(compose_train(*overrides, "max_restarts=1"))
    assert err.value.key == "max_restarts" and names in str(err.value)
    resolve_and_check(compose_train(*overrides, "max_restarts=0"))


# Nodes without a shared file system, and several nodes over a network: tests/test_netlab.py.


# --- what the nodes of one job compare (worker/node_agreement.py) ---------------------------


def _as_nodes(*configs: dict) -> list[dict]:
    return [
        {"node_rank": n, "hostname": f"host{n}", "address": "x", "config": c}
        for n, c in enumerate(configs)
    ]


def test_workers_derived_from_each_nodes_cores_may_differ(monkeypatch) -> None:
    """loader=tuned gives each rank its node's cores less one: nodes with other core
    counts are warned about, not refused (before: refused as different configs)."""
    from ddp_template.launch import topology
    from ddp_template.worker.node_agreement import _judge, flat_config, node_warnings

    cfg = compose_train("loader=tuned", "devices=1")
    configs = []
    for cores in (8, 4):
        monkeypatch.setattr(topology, "available_cores", lambda cores=cores: cores)
        configs.append(flat_config(cfg))
    nodes = _as_nodes(*configs)
    assert _judge(nodes, {}) == ""
    warning = node_warnings(nodes)
    assert "data.num_workers" in warning and "7 on node 0 (host0), 3 on node 1" in warning
    # A number the user set is not the node's own: it must agree.
    pinned = [flat_config(compose_train(f"data.num_workers={n}")) for n in (2, 3)]
    assert "data.num_workers: 2 on node 0 (host0), 3 on node 1" in _judge(_as_nodes(*pinned), {})


def test_a_data_root_from_the_environment_is_compared_by_content(monkeypatch, tmp_path) -> None:
    """DATA_ROOT mounted at another path on each node: the same files agree (a warning
    names the paths); other files are refused with the key, both paths and the nodes."""
    from ddp_template.worker.node_agreement import _judge, flat_config, node_warnings

    for name, data in (("a", b"same"), ("b", b"same"), ("c", b"other")):
        (tmp_path / name / "cifar-10-batches-py").mkdir(parents=True)
        (tmp_path / name / "cifar-10-batches-py" / "data_batch_1").write_bytes(data)
    cfg = compose_train("task=image_classification", "data=cifar10")
    flat = {}
    for name in ("a", "b", "c"):
        monkeypatch.setenv("DATA_ROOT", str(tmp_path / name))
        flat[name] = flat_config(cfg)
    same = _as_nodes(flat["a"], flat["b"])
    assert _judge(same, {}) == ""
    assert f'data.root: "{tmp_path / "a"}" (content ' in node_warnings(same)
    refused = _judge(_as_nodes(flat["a"], flat["c"]), {})
    assert refused.startswith("The nodes of this job were started with different configs: ")
    assert f'data.root: "{tmp_path / "a"}" (content ' in refused
    assert f'"{tmp_path / "c"}" (content ' in refused and "on node 1 (host1)" in refused


def test_software_versions_must_agree() -> None:
    import lightning
    import torch

    from ddp_template.worker.node_agreement import _judge, flat_config

    config = flat_config(compose_train())
    assert config["software.torch"] == torch.__version__
    assert config["software.lightning"] == lightning.__version__
    assert config["software.cuda"] == str(torch.version.cuda)
    assert config["software.ddp_template"] == "0.1.0"
    assert len(config["software.ddp_template_commit"].split("+")[0]) == 40
    for key, other in (("software.torch", "2.0.0"), ("software.ddp_template_commit", "0" * 40)):
        verdict = _judge(_as_nodes(config, {**config, key: other}), {})
        assert f'{key}: "{config[key]}" on node 0 (host0), "{other}" on node 1' in verdict
        assert "install the same code and versions on every node" in verdict


def test_backend_variables_must_agree_except_interface_names(monkeypatch) -> None:
    from ddp_template.worker.node_agreement import _judge, flat_config, node_warnings

    cfg = compose_train()
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    ring = flat_config(cfg)
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    tree = flat_config(cfg)
    verdict = _judge(_as_nodes(ring, tree), {})
    assert 'environment.NCCL_ALGO: "Ring" on node 0 (host0), "Tree" on node 1' in verdict
    assert "export the same NCCL_* / GLOO_* variables" in verdict
    monkeypatch.delenv("NCCL_ALGO")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    other_interface = flat_config(cfg)
    nodes = _as_nodes({**ring, "environment.NCCL_ALGO": None}, other_interface)
    nodes[0]["config"].pop("environment.NCCL_ALGO")
    assert _judge(nodes, {}) == ""
    assert 'environment.GLOO_SOCKET_IFNAME: "eth0" on node 0 (host0), "ib0"' in node_warnings(nodes)
