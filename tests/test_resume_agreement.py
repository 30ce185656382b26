"""All ranks resume from rank 0's checkpoint or the job stops: nodes that would choose
differently stop together with one message. (Nodes started with another ckpt_path or job
folder are refused earlier, by the start-of-job config check: tests/test_netlab.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

from ddp_template.resume.agreement import disagreement

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
