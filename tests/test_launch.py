"""One launch path: sweeps, Optuna, side-by-side runs, torchrun, several nodes, SLURM,
restarts. Every test runs real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers.runs import CPU, FAST, ROOT, free_port, results, start, train

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TINY_DDP = ["strategy=ddp", "devices=2", *FAST]


def job_folders(sweep_root: Path) -> list[Path]:
    (sweep,) = [p for p in sweep_root.glob("*/*") if p.is_dir()]
    return sorted(
        (p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    )


@pytest.mark.slow
def test_bucket_size_sweep_runs_one_ddp_job_per_value(tmp_path: Path) -> None:
    train("-m", *TINY_DDP, "strategy.bucket_cap_mb=25,50,100", cwd=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun"]  # no second folder
    jobs = job_folders(tmp_path / "multirun")
    assert [results(j)["ddp"]["bucket_cap_mb"] for j in jobs] == [25.0, 50.0, 100.0]
    for job in jobs:
        assert results(job)["world_size"] == 2
        assert sorted(p.name for p in (job / "logs" / "attempt_0").iterdir()) == ["0", "1"]
        assert (job / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
def test_a_bad_value_fails_its_job_only(tmp_path: Path) -> None:
    proc = train(
        "-m", *FAST, "strategy=ddp", "strategy.bucket_cap_mb=25,-1", cwd=tmp_path, check=False
    )
    assert proc.returncode != 0
    assert "strategy.bucket_cap_mb=-1 is not valid" in proc.stderr
    jobs = job_folders(tmp_path / "multirun")
    assert (jobs[0] / "results.json").is_file() and not (jobs[1] / "results.json").exists()


@pytest.mark.slow
def test_optuna_search_over_the_learning_rate(tmp_path: Path) -> None:
    train(
        "-m",
        "hparams_search=optuna_lr",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.sampler.n_startup_trials=2",
        *TINY_DDP,
        cwd=tmp_path,
    )
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    trials = [results(j) for j in job_folders(tmp_path / "multirun")]
    assert len(trials) == 3 and all(t["world_size"] == 2 for t in trials)
    assert best["best_value"] == max(t["val/acc_best"] for t in trials)
    best_lr = best["best_params"]["task.module.optimizer.lr"]
    assert best_lr in [t["config"]["task"]["module"]["optimizer"]["lr"] for t in trials]


@pytest.mark.slow
def test_grid_over_two_keys(tmp_path: Path) -> None:
    train("hparams_search=grid", *FAST, cwd=tmp_path)
    combos = {
        (r["config"]["task"]["module"]["optimizer"]["lr"], r["batch_size_per_device"])
        for r in map(results, job_folders(tmp_path / "multirun"))
    }
    assert combos == {(0.05, 32), (0.05, 64), (0.1, 32), (0.1, 64)}


@pytest.mark.slow
def test_two_runs_side_by_side(tmp_path: Path) -> None:
    procs = [
        start([sys.executable, str(ROOT / "train.py"), *TINY_DDP], cwd=tmp_path) for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    folders = sorted(p.parent for p in tmp_path.glob("outputs/*/*/results.json"))
    assert len(folders) == 2 and folders[0] != folders[1]


@pytest.mark.slow
def test_torchrun_trains_in_the_processes_it_started(tmp_path: Path) -> None:
    proc = start(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), *TINY_DDP],
        cwd=tmp_path,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    (job,) = [p.parent for p in tmp_path.glob("outputs/*/*/results.json")]
    assert results(job)["world_size"] == 2
    assert not (job / "logs").exists()  # no second launcher inside torchrun's workers
    assert len(list(tmp_path.glob("outputs/*/*"))) == 1
    assert (job / ".hydra" / "config.yaml").is_file() and "Run summary" in out


@pytest.mark.parametrize(("accelerator", "gpus"), [("gpu", 4), ("cpu", None)])
def test_slurm_launcher_config_maps_devices_and_nodes(accelerator: str, gpus) -> None:
    """One task per device on each node; GPUs asked only for a GPU run (a CPU partition
    refuses any GPU request)."""
    from hydra import compose, initialize_config_dir

    from ddp_template.config import resolvers
    from ddp_template.train import CONFIG_DIR

    resolvers.register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "launcher=slurm",
                "devices=4",
                "num_nodes=2",
                f"accelerator={accelerator}",
                "hydra.launcher.partition=gpu",
            ],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, gpus)
    assert launcher.partition == "gpu" and launcher.timeout_min == 240
    assert launcher.cpus_per_task >= 1


@pytest.mark.slow
def test_submitit_local_executor_runs_a_job(tmp_path: Path) -> None:
    train("-m", "launcher=submitit_local", *TINY_DDP, cwd=tmp_path, timeout=400)
    (job,) = job_folders(tmp_path / "multirun")
    assert results(job)["world_size"] == 2


def test_missing_launcher_plugin_is_named(monkeypatch) -> None:
    import importlib.util

    from ddp_template.config.plugins import require_plugins
    from ddp_template.errors import ConfigError

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if "submitit" in name else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match="hydra-submitit-launcher"):
        require_plugins(["-m", "launcher=slurm"])


# Two epochs of 4 steps; last.ckpt every 5 steps; rank 1 killed right after step 5.
RESTART_RUN = [
    CPU,
    "strategy=ddp",
    "devices=2",
    "data=synthetic",
    "data.num_samples=256",
    "data.eval_samples=32",
    "data.image_size=8",
    "data.batch_size=32",
    "trainer.max_epochs=2",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
    "logger=none",
    "test=false",
    "callbacks.last_checkpoint.every_n_train_steps=5",
]
KILL_RANK_ONE = ["+callbacks.kill._target_=faults.KillRankAfterStep", "+callbacks.kill.step=5"]


def _restart_run(job: Path, max_restarts: int, *extra: str) -> subprocess.CompletedProcess:
    return train(
        *RESTART_RUN,
        *extra,
        f"max_restarts={max_restarts}",
        f"hydra.run.dir={job}",
        cwd=job.parent,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_killed_worker_restarts_and_resumes_exactly(tmp_path: Path) -> None:
    """The restarted group continues from last.ckpt (step 5, mid-epoch) and ends with the
    weights of a run that was never killed: a restart from scratch would end differently."""
    uninterrupted = tmp_path / "full"
    assert _restart_run(uninterrupted, 0).returncode == 0
    job = tmp_path / "run"
    proc = _restart_run(job, 1, *KILL_RANK_ONE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = results(job)
    assert record["restarts"] == 1 and record["resumed_from"].endswith("last.ckpt")
    first, restarted = record["attempts"]
    assert first["began"] == "fresh" and first["start_step"] == 0
    assert restarted["began"] == "restart" and restarted["start_step"] == 5
    assert (job / "logs" / "attempt_1").is_dir()
    weights = [torch.load(j / "model.pt", weights_only=True) for j in (job, uninterrupted)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[1])


@pytest.mark.slow
def test_killed_worker_without_restarts_fails_fast_and_names_it(tmp_path: Path) -> None:
    job = tmp_path / "run"
    proc = _restart_run(job, 0, *KILL_RANK_ONE)
    killed_at = (job / "checkpoints" / "last.ckpt").stat().st_mtime
    assert time.time() - killed_at < 60
    assert proc.returncode != 0
    assert "Worker rank 1" in proc.stderr and "SIGKILL" in proc.stderr
    assert str(job / "logs" / "attempt_0" / "1") in proc.stderr
    assert not (job / "results.json").exists()


@pytest.mark.slow
def test_ddp_spawn_sweep(tmp_path: Path) -> None:
    """The articles' mp.spawn: Lightning spawns inside each job; two jobs, one sweep."""
    train("-m", *FAST, "strategy=ddp_spawn", "devices=2", "seed=1,2", cwd=tmp_path)
    jobs = job_folders(tmp_path / "multirun")
    assert [results(j)["config"]["seed"] for j in jobs] == [1, 2]
    assert all(
        results(j)["world_size"] == 2 and results(j)["strategy"] == "ddp_spawn" for j in jobs
    )
    assert all("test/acc" in results(j) for j in jobs)


@pytest.mark.slow
def test_a_worker_exception_is_shown_once_with_its_rank(tmp_path: Path) -> None:
    job = tmp_path / "run"
    proc = train(
        *TINY_DDP,
        "+callbacks.fail._target_=probe.FailOnRank",
        f"hydra.run.dir={job}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2
    console = proc.stdout + proc.stderr
    assert console.count("Traceback (most recent call last)") == 1
    assert "ValueError: deliberate failure on rank 1" in console
    assert "Worker rank 1" in proc.stderr
    assert str(job / "logs" / "attempt_0" / "1") in proc.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("cluster")  # the one-machine SLURM: see test_slurm.py
def test_tasks_started_by_srun_train_in_place(tmp_path: Path) -> None:
    """Two processes with the environment srun gives its tasks (no cluster needed): Lightning's
    SLURM environment ranks them, no launcher starts more, both agree on one job folder."""
    port = free_port()
    tasks = []
    for rank in (0, 1):
        slurm_env = {
            "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_NAME": "train",
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_NODELIST": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        tasks.append(
            start([sys.executable, str(ROOT / "train.py"), *TINY_DDP], cwd=tmp_path, env=slurm_env)
        )
    outputs = [t.communicate(timeout=300) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], [o[1][-2000:] for o in outputs]
    job = tmp_path / "outputs" / "slurm" / "4242.0"
    assert results(job)["world_size"] == 2
    assert not (job / "logs").exists()
    assert [p.name for p in (tmp_path / "outputs" / "slurm").iterdir()] == ["4242.0"]


@pytest.mark.slow
def test_sweep_over_the_number_of_devices(tmp_path: Path) -> None:
    """With Lightning's own launcher, `-m devices=2,1` crashed a child; each job here starts
    its own workers and leaves nothing behind for the next."""
    train("-m", "strategy=ddp", "devices=2,1", *FAST, cwd=tmp_path)
    assert [results(j)["world_size"] for j in job_folders(tmp_path / "multirun")] == [2, 1]


def _raise_into_error_file(error_file: Path, error: Exception, monkeypatch) -> None:
    """What `@record` writes when a rank raises: torch's own error file."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise error
    except type(error) as raised:
        ErrorHandler().record_exception(raised)


def test_the_cause_is_named_when_the_agent_saw_a_rank_it_brought_down_first(
    tmp_path: Path, monkeypatch
) -> None:
    """Rank 1 raised, rank 0's all-reduce broke under it, and both ended between two looks
    of the agent, which reported rank 0 only: rank 1's error file names the cause. An error
    file of an earlier launch into the same folder does not count."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddp_template.launch.agent import describe_failure

    attempt = tmp_path / "logs" / "attempt_0"
    brought_down = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    _raise_into_error_file(attempt / "0" / "error.json", brought_down, monkeypatch)
    own = ValueError("deliberate failure on rank 1")
    _raise_into_error_file(attempt / "1" / "error.json", own, monkeypatch)
    reported = ProcessFailure(0, 4242, 1, str(attempt / "0" / "error.json"))
    error = ChildFailedError("fit_and_test", {0: reported})

    named = describe_failure(error, tmp_path / "logs", since=time.time() - 60)
    assert str(named).startswith("Worker rank 1 exited with code 1: ValueError: deliberate")
    assert "deliberate failure on rank 1" in named.details
    stale = describe_failure(error, tmp_path / "logs", since=time.time() + 60)
    assert str(stale).startswith("Worker rank 0 (pid 4242) exited with code 1: RuntimeError")
