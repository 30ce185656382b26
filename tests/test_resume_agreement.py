"""All ranks resume from rank 0's checkpoint or the job stops: nodes that would choose
differently (other job folders, other arguments) stop together with one message."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import FAST, ROOT, free_port, start, train

from ddp_template.callbacks.resume_agreement import disagreement

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def test_ranks_that_agree_pass_and_others_are_named() -> None:
    same = [("/job/checkpoints/last.ckpt", node, f"host{node}") for node in (0, 0, 1, 1)]
    assert disagreement(same) is None
    split = [*same[:2], (None, 1, "host1"), (None, 1, "host1")]
    message = disagreement(split)
    assert message is not None and "\n" not in message
    assert "rank 0 (node 0, host0) from /job/checkpoints/last.ckpt" in message
    assert "rank(s) 2, 3 on node(s) 1 (host1) from nothing (a fresh start)" in message
    assert "Fix:" in message


@pytest.mark.slow
def test_nodes_that_would_resume_differently_stop_together(tmp_path: Path) -> None:
    """Two torchrun agents ("nodes") on 127.0.0.1; only node 0 is given the checkpoint."""
    overrides = [*FAST, "trainer.max_epochs=2", "test=false", "~callbacks.model_checkpoint"]
    train(*overrides, f"hydra.run.dir={tmp_path / 'first'}", cwd=tmp_path)
    checkpoint = tmp_path / "first" / "checkpoints" / "last.ckpt"
    port = free_port()
    agents = [
        start(
            [
                TORCHRUN,
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=1",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=disagree",
                str(ROOT / "train.py"),
                "strategy=ddp",
                *overrides,
                *([f"ckpt_path={checkpoint}"] if node == 0 else []),
            ],
            cwd=tmp_path,
        )
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    for agent, (out, err) in zip(agents, outputs, strict=True):
        assert agent.returncode != 0, err[-3000:]
        assert "would resume from different checkpoints" in err, err[-3000:]
        assert "rank(s) 1 on node(s) 1" in err and "Fix:" in err
        assert "epoch 1/" not in out
