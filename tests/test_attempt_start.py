"""An attempt continues a job's earlier state only when the config or its launcher says so
(a restart, a requeue, `resume=true`): a rerun under the same job id is refused, and a
restart or requeue with no usable checkpoint stops instead of training again from step 0."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.runs import FAST, ROOT, compose_train, subprocess_env, train
from omegaconf import OmegaConf, open_dict

from ddp_template.errors import ConfigError, TrainingStopped
from ddp_template.resume.folder import check_first_attempt_folder

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _job_folder(folder: Path, *overrides: str) -> Path:
    """A folder as a run of `overrides` leaves it: its saved config and a checkpoint."""
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose_train(*overrides), folder / ".hydra" / "config.yaml")
    (folder / "checkpoints").mkdir()
    torch.save({"global_step": 5}, folder / "checkpoints" / "last.ckpt")
    return folder


def test_a_first_attempt_refuses_a_folder_with_an_earlier_runs_state(tmp_path: Path) -> None:
    folder = _job_folder(tmp_path / "job", "task=regression")
    cfg = compose_train("task=regression", "task.module.optimizer.lr=0.5")
    with pytest.raises(ConfigError) as refused:
        check_first_attempt_folder(folder, cfg, folder / ".hydra" / "config.yaml")
    message = str(refused.value)
    assert "\n" not in message and str(folder) in message and "last.ckpt" in message
    assert "task.module.optimizer.lr (0.01 there, 0.5 here)" in message
    assert "--rdzv-id=<new>" in message and "resume=true" in message
    # The same config: refused too (a rerun is no continuation), saying so.
    with pytest.raises(ConfigError, match="of the same config"):
        check_first_attempt_folder(
            folder, compose_train("task=regression"), folder / ".hydra" / "config.yaml"
        )
    # A start from ckpt_path is the config's own choice, unless the run had finished.
    with open_dict(cfg):
        cfg.ckpt_path = str(folder / "checkpoints" / "last.ckpt")
    check_first_attempt_folder(folder, cfg, None)
    (folder / "results.json").write_text('{"finished_at": "then"}')
    with pytest.raises(ConfigError, match="results.json"):
        check_first_attempt_folder(folder, cfg, None)
    check_first_attempt_folder(tmp_path / "new", cfg, None)


def test_a_restart_without_a_usable_checkpoint_stops_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from ddp_template.resume.decision import resume_point

    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    last.write_bytes(b"torn")
    cfg = OmegaConf.create({"paths": {"output_dir": str(tmp_path)}, "ckpt_path": None})
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(TrainingStopped) as stopped:
        resume_point(cfg)
    message = str(stopped.value)
    assert "\n" not in message and str(last) in message and "restart_from_scratch=true" in message
    assert last.read_bytes() == b"torn"

    cfg.restart_from_scratch = True
    assert resume_point(cfg) is None
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and "restart_from_scratch=true" in printed[0]


# An elastic agent (a parent that starts workers one after another, as torchrun restarts
# them) and its workers, each noting its attempt in the job folder.
_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from ddp_template.resume.agent_records import note_agent_attempt, rejoined_by_agent
    job, barrier, siblings = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    # One write: two workers share the pipe, unbuffered (PYTHONUNBUFFERED).
    os.write(1, f"{rejoined_by_agent(job)}\\n".encode())
    note_agent_attempt(job)
    # Ends once every worker of its attempt has looked and noted (all alive till then).
    barrier.mkdir(exist_ok=True)
    (barrier / str(os.getpid())).touch()
    while len(list(barrier.iterdir())) < siblings:
        time.sleep(0.05)
    """
)
_AGENT = textwrap.dedent(
    """
    import os, subprocess, sys, tempfile
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job"}
    def attempt(workers):
        barrier = tempfile.mkdtemp()
        args = [sys.executable, "-c", sys.argv[2], sys.argv[1], barrier, str(workers)]
        procs = [subprocess.Popen(args, env=env) for _ in range(workers)]
        for proc in procs:
            proc.wait()
    # Two workers side by side (neither sees a rejoin: its sibling runs), then the
    # attempt after them, as torchrun restarts its workers.
    attempt(2)
    attempt(1)
    """
)


def test_an_agent_tells_its_workers_rejoin_from_a_rerun(tmp_path: Path) -> None:
    def agent() -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-c", _AGENT, str(tmp_path), _WORKER],
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=120,
            check=True,
        )
        return proc.stdout.split()

    assert agent() == ["False", "False", "True"]
    # A rerun under the same job id: another agent, a first attempt again.
    assert agent() == ["False", "False", "True"]
    host = socket.gethostname()
    assert len(list((tmp_path / ".agents").glob(f"{host}.*"))) == 6


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three runs of train.py
def test_a_rerun_or_requeue_in_a_folder_with_state_stops_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """A rerun with another config in the same folder, then a requeue finding its
    checkpoint torn and no previous one: one paragraph each, exit 2, nothing written."""
    job = tmp_path / "job"
    run = [*FAST, "task=regression", "~callbacks.model_checkpoint", f"hydra.run.dir={job}"]
    train(*run, cwd=tmp_path)
    last = job / "checkpoints" / "last.ckpt"
    before = {path: path.read_bytes() for path in (last, job / "results.json")}

    rerun = train(*run, "seed=7", cwd=tmp_path, check=False)
    assert rerun.returncode == 2, rerun.stderr[-3000:]
    refusal = [line for line in rerun.stderr.splitlines() if line.startswith("error:")]
    assert len(refusal) == 1 and "seed (" in refusal[0] and "resume=true" in refusal[0]
    assert {path: path.read_bytes() for path in before} == before

    (job / "results.json").unlink()
    last.write_bytes(before[last][:1000])
    requeued = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *run],
        cwd=tmp_path,
        env=subprocess_env(SLURM_RESTART_COUNT="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert requeued.returncode == 2, requeued.stderr[-3000:]
    refusal = [line for line in requeued.stderr.splitlines() if line.startswith("error:")]
    assert len(refusal) == 1 and str(last) in refusal[0], requeued.stderr[-3000:]
    assert "restart_from_scratch=true" in refusal[0]
    assert last.read_bytes() == before[last][:1000] and not (job / "results.json").exists()


def _torchrun_nodes(cwd: Path, rdzv_id: str, *overrides: str) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents on this machine, one worker each, a c10d rendezvous on loopback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        TORCHRUN,
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--rdzv_id={rdzv_id}",
        str(ROOT / "train.py"),
        "strategy=ddp",
        "num_nodes=2",
        *FAST,
        *overrides,
    ]
    env = subprocess_env(GLOO_SOCKET_IFNAME="lo")
    procs = [
        subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two jobs of two torchrun nodes
def test_a_rerun_under_the_same_torchrun_job_id_is_refused(tmp_path: Path) -> None:
    """Two torchrun nodes, `--rdzv_id=run100`, then the same id with a new learning rate:
    it used to continue the old run's weights silently (or, finished, report them)."""
    run = ["task=regression", "~callbacks.model_checkpoint"]
    first = _torchrun_nodes(tmp_path, "run100", *run)
    assert [p.returncode for p in first] == [0, 0], first[0].stderr[-3000:]
    job = tmp_path / "outputs" / "torchrun" / "run100"
    saved = {name: (job / name).read_bytes() for name in ("checkpoints/last.ckpt", "results.json")}

    rerun = _torchrun_nodes(tmp_path, "run100", *run, "task.module.optimizer.lr=0.5")
    assert all(p.returncode != 0 for p in rerun)
    output = "".join(p.stderr for p in rerun)
    refusal = [line for line in output.splitlines() if "is not valid" in line]
    assert len(refusal) == 1, output[-3000:]
    assert (
        "outputs/torchrun/run100" in refusal[0]
        and "task.module.optimizer.lr (0.01 there, 0.5 here)" in refusal[0]
    )
    assert {name: (job / name).read_bytes() for name in saved} == saved
