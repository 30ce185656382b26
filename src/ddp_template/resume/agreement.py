"""Every rank resumes from the checkpoint rank 0 resumes from, or the job stops.

Each rank picks what it resumes from itself, before the process group exists: `ckpt_path`,
or on a restart or requeue its own `<job>/checkpoints/last.ckpt` (train.py). Nodes that see
different job folders (torchrun on several nodes without `--rdzv-id` names the folder after
each node's own agent) or different files decide differently: rank 0 resumes at step N and
another rank starts at step 0. DDP's first broadcast hides the weights, but optimizer state
and loop counters differ, and the job diverges or hangs at its end. So once the process
group is up and the checkpoint is chosen, the ranks compare their choice with rank 0's (one
all_gather of a short string, at the start of fit only) and all stop together with one
message naming the ranks and nodes that chose otherwise.
"""

from __future__ import annotations

import socket

import lightning as L
import torch.distributed as dist

from ddp_template.errors import TrainingStopped

# (checkpoint or None, node rank, host name) of one rank.
Choice = tuple[str | None, int, str]


class ResumeAgreement(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size < 2 or not dist.is_available() or not dist.is_initialized():
            return
        path = str(trainer.ckpt_path) if trainer.ckpt_path else None
        mine: Choice = (path, trainer.node_rank, socket.gethostname())
        everyone: list[Choice] = [mine] * trainer.world_size
        dist.all_gather_object(everyone, mine)
        message = disagreement(everyone)
        if message:
            raise TrainingStopped(message)


def disagreement(choices: list[Choice]) -> str | None:
    """The message when some rank resumes from something else than rank 0 (None: all agree)."""
    leader = choices[0][0]
    others = [
        (rank, node, host) for rank, (path, node, host) in enumerate(choices) if path != leader
    ]
    if not others:
        return None
    chosen = {path for path, _, _ in choices[1:] if path != leader}
    ranks = ", ".join(str(rank) for rank, _, _ in others)
    nodes = ", ".join(sorted({f"{node} ({host})" for _, node, host in others}))
    return (
        f"The ranks of this job would resume from different checkpoints: rank 0 (node "
        f"{choices[0][1]}, {choices[0][2]}) from {_name(leader)}, rank(s) {ranks} on node(s) "
        f"{nodes} from {' or '.join(sorted(_name(p) for p in chosen))}. Each rank chooses "
        "from its own job folder (a restart or requeue resumes from "
        "<job>/checkpoints/last.ckpt) and its own ckpt_path, so the nodes see different "
        "folders or were given different arguments; optimizer state and loop counters would "
        "differ across ranks. Fix: give every node the same command and the same job folder "
        "(torchrun --rdzv-id=<id> names it the same on every node; or set hydra.run.dir to "
        "one shared path), then run again"
    )


def _name(path: str | None) -> str:
    return path if path else "nothing (a fresh start)"
