"""`strategy=fsdp` keeps `ddp`'s promises (docs/fsdp.md): 2 ranks end with the weights of
one process on the global batch, and with those of `ddp` on the same run; its sharded
checkpoints resume at another world size from the same sample, load into `ddp` and back;
`model.pt` is one plain state_dict either way. Real gloo processes, started by train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runs import ROOT, results, subprocess_env, train
from test_every_task import COMMON, TASKS, _distance

from ddp_template.errors import UserFacingError
from ddp_template.resume.checkpoint_io import plain_from_sharded
from ddp_template.tools.netlab import Lab, require_namespaces

FSDP = ["strategy=fsdp", "devices=2"]
DDP = ["strategy=ddp", "devices=2"]
# fp32 on the CPU: two ranks of B and one process of 2B differ by float rounding alone.
RELATIVE = 1e-6


def final_state(job: Path) -> dict[str, torch.Tensor]:
    """The module's state at the end of training, from last.ckpt, sharded or not."""
    path = job / "checkpoints" / "last.ckpt"
    if path.is_dir():
        return plain_from_sharded(path)["state_dict"]
    return torch.load(path, weights_only=True, map_location="cpu")["state_dict"]


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over every floating-point tensor."""
    zeros = {key: torch.zeros_like(value) for key, value in b.items()}
    return _distance(a, b) / _distance(b, zeros)


def _three_runs(tmp_path: Path, common: list[str], batch: int) -> dict[str, dict]:
    states = {}
    for name, extra in (
        ("fsdp", FSDP),
        ("ddp", DDP),
        ("one", ["devices=1", f"data.batch_size={2 * batch}"]),
    ):
        job = tmp_path / name
        train(*common, *extra, "test=false", f"hydra.run.dir={job}", cwd=tmp_path)
        states[name] = final_state(job)
    return states


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("task", TASKS)
def test_fsdp_ends_with_the_weights_of_one_process_and_of_ddp(task: str, tmp_path: Path) -> None:
    from helpers.runs import compose_train

    batch = int(compose_train(f"task={task}").data.batch_size)
    states = _three_runs(tmp_path, [f"task={task}", *COMMON], batch)
    assert states["fsdp"].keys() == states["one"].keys()
    to_one, to_ddp, ddp_to_one = (
        relative(states["fsdp"], states["one"]),
        relative(states["fsdp"], states["ddp"]),
        relative(states["ddp"], states["one"]),
    )
    print(
        f"{task}: fsdp vs one process {to_one:.3g}, fsdp vs ddp {to_ddp:.3g}, "
        f"ddp vs one process {ddp_to_one:.3g}"
    )
    # fsdp reduces as ddp does, and is as near one process as ddp's float rounding lets it
    # be (a deep network's rounding, 2 x B against 2B, is above 1e-6: ResNet-18 9e-6).
    assert to_ddp <= RELATIVE
    assert to_one <= max(RELATIVE, 2 * ddp_to_one)
    # A wrong reduction (a sum instead of a mean) moves the weights by 1e-3 and more
    # (test_uneven_shapes_and_batch_norm_average_as_one_process); rounding stays far below.
    assert ddp_to_one <= 1e-4
    _holds_a_share_of_the_model_state(tmp_path)


def _holds_a_share_of_the_model_state(tmp_path: Path) -> None:
    """results.json's spread of the model state over ranks: every ddp rank holds all of
    it, each fsdp rank about half (shards split each tensor's first dimension, rounded up
    on the first ranks), and the fsdp ranks together hold it once."""
    whole = results(tmp_path / "one")["model_state_mb_over_ranks"]
    for part in ("parameters", "optimizer_state"):
        full = whole[part]["max"]
        ddp = results(tmp_path / "ddp")["model_state_mb_over_ranks"][part]
        fsdp = results(tmp_path / "fsdp")["model_state_mb_over_ranks"][part]
        assert ddp["min"] == ddp["max"] == full and ddp["sum"] == pytest.approx(2 * full, rel=1e-4)
        assert fsdp["sum"] == pytest.approx(full, rel=1e-3), (part, fsdp, full)
        assert full / 2 <= fsdp["max"] <= 0.6 * full, (part, fsdp, full)
        assert set(fsdp) == {"min", "median", "max", "min_rank", "max_rank", "sum"}


UNEVEN = [
    "task=tabular_classification",
    # 13 features, 3 classes: every weight's first dimension is odd.
    "data=wine",
    "data.batch_size=16",
    *COMMON,
    "task.module.model._target_=uneven.uneven_mlp",
    # SGD: a gradient summed over the 2 ranks instead of averaged is then exactly one
    # process's step at twice the learning rate (weight decay halved to stay as it was);
    # Adam would hide the factor of 2.
    "task.module.optimizer._target_=torch.optim.SGD",
]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_uneven_shapes_and_batch_norm_average_as_one_process(tmp_path: Path) -> None:
    """pytorch#162338: gloo's AVG reduce-scatter of shards of uneven size. Every parameter
    of the network has a size that 2 does not divide (Linear(3, 5) among them), and a batch
    norm layer is sharded with them."""
    from helpers.runs import compose_train

    cfg = compose_train(*UNEVEN)
    batch, lr, decay = (
        int(cfg.data.batch_size),
        float(cfg.task.module.optimizer.lr),
        float(cfg.task.module.optimizer.weight_decay),
    )
    one = ["devices=1", f"data.batch_size={2 * batch}", "test=false"]
    runs = {
        "fsdp": [*FSDP, "test=false"],
        "one": one,
        "summed": [
            *one,
            f"task.module.optimizer.lr={2 * lr}",
            f"task.module.optimizer.weight_decay={decay / 2}",
        ],
    }
    states = {}
    for name, extra in runs.items():
        train(*UNEVEN, *extra, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        states[name] = final_state(tmp_path / name)
    shapes = [tuple(v.shape) for k, v in states["one"].items() if k.endswith("weight")]
    assert (5, 3) in shapes and all(s[0] % 2 for s in shapes), shapes
    right, wrong = (
        relative(states["fsdp"], states["one"]),
        relative(states["summed"], states["one"]),
    )
    print(f"fsdp vs one process {right:.3g}; a sum instead of the mean {wrong:.3g}")
    assert right <= RELATIVE
    # The check can fail: the wrong reduction lies far outside the tolerance.
    assert wrong > 1000 * RELATIVE


RESHARD = ["task=tabular_classification", *COMMON, "test=false"]
STOP_AT_STEP = 4


def _stopped(tmp_path: Path, name: str, *world: str) -> Path:
    job = tmp_path / name
    proc = train(
        *RESHARD,
        *world,
        "+callbacks.stop._target_=faults.StopAfterCheckpoint",
        f"+callbacks.stop.step={STOP_AT_STEP}",
        f"hydra.run.dir={job}",
        cwd=tmp_path,
        check=False,
    )
    checkpoint = job / "checkpoints" / "last.ckpt"
    assert proc.returncode != 0 and checkpoint.exists(), proc.stderr[-3000:]
    return checkpoint


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sharded_checkpoints_resume_at_another_world_size_and_across_strategies(
    tmp_path: Path,
) -> None:
    """Stopped after step 4 (mid-epoch 2), resumed: 2 -> 1 and 1 -> 2 ranks of fsdp, ddp ->
    fsdp and fsdp -> ddp, each ending where the run without a stop ends (AdamW: its state
    must come through the checkpoint too)."""
    from helpers.runs import compose_train

    batch = int(compose_train(*RESHARD).data.batch_size)
    one = ["devices=1", f"data.batch_size={2 * batch}"]
    full = tmp_path / "full"
    train(*RESHARD, *FSDP, f"hydra.run.dir={full}", cwd=tmp_path)
    expected = final_state(full)

    two_shards = _stopped(tmp_path, "fsdp2", *FSDP)
    assert sorted(p.name for p in two_shards.iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    one_shard = _stopped(tmp_path, "fsdp1", "strategy=fsdp", *one)
    of_ddp = _stopped(tmp_path, "ddp2", *DDP)
    assert of_ddp.is_file()
    cases = {
        "2->1": (two_shards, ["strategy=fsdp", *one], 1),
        "1->2": (one_shard, FSDP, 2),
        "ddp->fsdp": (of_ddp, FSDP, 2),
        "fsdp->ddp": (two_shards, DDP, 2),
    }
    at_stop = plain_from_sharded(two_shards)["state_dict"]
    moved = relative(expected, at_stop)
    for name, (checkpoint, world, ranks) in cases.items():
        job = tmp_path / f"resumed{name.replace('->', '_to_')}"
        train(*RESHARD, *world, f"ckpt_path={checkpoint}", f"hydra.run.dir={job}", cwd=tmp_path)
        attempts = results(job)["attempts"]
        assert [(a["start_step"], a["world_size"]) for a in attempts[-1:]] == [
            (STOP_AT_STEP, ranks)
        ], name
        difference = relative(final_state(job), expected)
        print(
            f"{name}: {difference:.3g} from the run without a stop (the last steps moved {moved:.3g})"
        )
        assert difference <= RELATIVE, name
        bare = torch.load(job / "model.pt", weights_only=True)
        assert all(type(v) is torch.Tensor for v in bare.values()), name
        assert bare.keys() == {k.removeprefix("model.") for k in expected}, name


def _save_folder(folder: Path, name: str, step: int) -> Path:
    """A complete sharded checkpoint folder as ShardedStrategy publishes it."""
    import torch.distributed.checkpoint as dcp

    from ddp_template.worker.sharding import publish_folder

    temporary = folder / f".{name}.tmp"
    dcp.save({"state_dict": {"w": torch.ones(5, 3) * step}}, checkpoint_id=temporary, no_dist=True)
    torch.save({"global_step": step, "loops": {}}, temporary / "meta.pt")
    publish_folder(temporary, folder / name)
    return folder / name


def test_a_sharded_checkpoint_keeps_its_previous_one_and_a_torn_one_falls_back(
    tmp_path: Path,
) -> None:
    from ddp_template.resume.checkpoint_check import newest_complete, unreadable
    from ddp_template.resume.checkpoint_io import previous_of

    last = _save_folder(tmp_path, "last.ckpt", 1)
    _save_folder(tmp_path, "last.ckpt", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.prev.ckpt"]
    assert torch.load(last / "meta.pt")["global_step"] == 2
    assert torch.load(previous_of(last) / "meta.pt")["global_step"] == 1
    assert newest_complete(last) == (last, None)

    shard = next(last.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    assert "cut short" in (unreadable(last) or "")
    resume_from, note = newest_complete(last)
    assert resume_from == previous_of(last) and note and "last.prev.ckpt" in note

    # Killed between the two renames: no last.ckpt, the previous one complete.
    import shutil

    shutil.rmtree(last)
    assert newest_complete(last)[0] == previous_of(last)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_process_killed_while_writing_shards_resumes_from_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    import signal
    import sys
    import time

    from helpers.runs import FAST, ROOT, start

    from ddp_template.resume.checkpoint_check import newest_complete, unreadable

    job = tmp_path / "run"
    overrides = [
        *FAST,
        "task=regression",
        "strategy=fsdp",
        "devices=1",
        "trainer.limit_train_batches=4",
        "test=false",
        "~callbacks.model_checkpoint",
        "callbacks.last_checkpoint.every_n_train_steps=1",
        f"hydra.run.dir={job}",
    ]
    proc = start(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *overrides,
            "+callbacks.stall._target_=faults.HalfWrittenShards",
        ],
        cwd=tmp_path,
    )
    marker = job / "writing"
    # Generous: a busy shared machine took minutes to reach the first step.
    deadline = time.monotonic() + 1200
    try:
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        failed = proc.poll() is not None
        assert marker.exists(), proc.communicate()[1][-3000:] if failed else "no save stalled"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()

    folder = job / "checkpoints"
    torn = folder / ".last.ckpt.tmp"
    assert torn.is_dir() and "cut short" in (unreadable(torn) or ""), "no half-written shard"
    last = folder / "last.ckpt"
    assert newest_complete(last) == (last, None)
    assert torch.load(last / "meta.pt")["global_step"] == int(marker.read_text()) - 1
    # A run resumed from it continues at its step.
    resumed = tmp_path / "resumed"
    train(*overrides, f"ckpt_path={last}", f"hydra.run.dir={resumed}", cwd=tmp_path)
    assert results(resumed)["attempts"][-1]["start_step"] == int(marker.read_text()) - 1


def _on_lab_nodes(
    prefix: str, nodes: int, cwd: Path, job: Path, *overrides: str
) -> tuple[dict[int, int], dict[int, str]]:
    """A lab of `nodes` nodes made for this run and removed after it; train.py on every
    node as its own agent (one worker each), forked from one process that imported the
    project once (`netlab_fork`), each node in its own network namespace, hostname and
    address. Returns each node's exit code and the tail of its output."""
    lab = Lab.up(nodes, "1gbit", prefix=prefix, memory_per_node_mb=600)
    try:
        return _run_on(lab, cwd, job, *overrides)
    finally:
        lab.down()


def _run_on(
    lab: Lab, cwd: Path, job: Path, *overrides: str
) -> tuple[dict[int, int], dict[int, str]]:
    command = [
        sys.executable,
        "-m",
        "ddp_template.tools.netlab_fork",
        "--prefix",
        lab.prefix,
        "--logs",
        str(cwd),
        "--",
        str(ROOT / "train.py"),
        *RESHARD,
        "strategy=fsdp",
        "devices=1",
        f"num_nodes={len(lab.nodes)}",
        "network.node_rank={node}",
        f"network.master_addr={lab.nodes[0].hostname}",
        f"network.job_id={job.name}{os.getpid()}",
        f"hydra.run.dir={job}",
        *overrides,
    ]
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        command,
        cwd=cwd,
        env=subprocess_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    logs = {n.index: (cwd / f"node{n.index}.log") for n in lab.nodes}
    assert done.stdout.strip(), done.stderr[-3000:]
    codes = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    return codes, {i: p.read_text()[-3000:] if p.exists() else "" for i, p in logs.items()}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.xdist_group("cluster")
def test_a_sharded_checkpoint_of_two_lab_nodes_resumes_on_four(tmp_path: Path) -> None:
    """Two lab nodes of fsdp stop after step 4 (each writes its shard from its own
    namespace); four nodes resume from that folder with half the batch each (the same
    global batch) and end where two ranks without a stop end: the checkpoint is resharded
    from 2 to 4 and the loader goes on from the global sample position."""
    from helpers.runs import compose_train

    try:
        require_namespaces()
    except UserFacingError as why:
        pytest.skip(str(why))
    batch = int(compose_train(*RESHARD).data.batch_size)
    assert batch % 2 == 0, batch
    full = tmp_path / "full"
    train(*RESHARD, *FSDP, f"hydra.run.dir={full}", cwd=tmp_path)
    expected = final_state(full)

    stopped = tmp_path / "stopped"
    tag = os.getpid() % 100000
    codes, logs = _on_lab_nodes(
        f"fs{tag}",
        2,
        tmp_path / "two",
        stopped,
        "+callbacks.stop._target_=faults.StopAfterCheckpoint",
        f"+callbacks.stop.step={STOP_AT_STEP}",
    )
    checkpoint = stopped / "checkpoints" / "last.ckpt"
    # Each node's agent reports its worker's exit (the stop's code) and exits non-zero.
    assert all(code != 0 and "exited with code 75" in logs[n] for n, code in codes.items()), logs
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resumed = tmp_path / "resumed"
    codes, logs = _on_lab_nodes(
        f"fr{tag}",
        4,
        tmp_path / "four",
        resumed,
        f"data.batch_size={batch // 2}",
        f"ckpt_path={checkpoint}",
    )
    assert codes == dict.fromkeys(range(4), 0), logs
    record = results(resumed)
    assert record["world_size"] == 4 and record["num_nodes"] == 4
    assert len({n["hostname"] for n in record["nodes"]}) == 4
    attempt = record["attempts"][-1]
    assert (attempt["start_step"], attempt["world_size"]) == (STOP_AT_STEP, 4)
    moved = relative(expected, plain_from_sharded(checkpoint)["state_dict"])
    difference = relative(final_state(resumed), expected)
    print(
        f"2 lab nodes -> 4: {difference:.3g} from the run without a stop (the last steps moved {moved:.3g})"
    )
    assert difference <= RELATIVE
    assert moved > 1000 * RELATIVE
