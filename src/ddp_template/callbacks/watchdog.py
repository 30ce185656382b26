"""Hang watchdog: when no step finishes in time, every rank writes where it is stuck.

A hung DDP job usually has one rank somewhere unexpected (a slow step, a dead loader, a
branch that skips a collective) and all the others waiting for it inside a collective,
silently, until the process-group timeout (30 minutes by default) ends the job. Here a
thread on every rank watches the training progress. When none has been made for
`timeout_s` seconds, each rank writes the Python stacks of all its threads, and the
collectives its process group recorded when the flight recorder is on, to
`<dir>/rank_<N>.txt`; rank 0 prints where the files are and which collective each rank is
in. Then every rank exits (`on_hang: exit`) or keeps waiting (`on_hang: wait`).

At any time, `kill -QUIT <pid>` writes the stacks of one rank into its stderr log (as
`kill -3` does for a JVM): SIGQUIT, because SIGUSR1 and SIGUSR2 belong to the SLURM
preemption handlers (Lightning's and submitit's). The thread lives as long as the stage it
watches: teardown and a failure stop it, so nothing armed outlives a failed job of a sweep.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from ddp_template.errors import TrainingStopped

ON_HANG = ("exit", "wait")
# How long rank 0 waits for the other ranks' files, and they for its report, after a hang.
_GATHER_S = 10.0
_SUMMARY = "summary.txt"
# `kill -QUIT <pid>`: a rank writes its stacks (a signal no launcher or scheduler uses).
STACKS_SIGNAL = getattr(signal, "SIGQUIT", None)


class HangWatchdog(L.Callback):
    """Watches fit, validation and test; a batch or epoch boundary counts as progress."""

    def __init__(self, timeout_s: float = 600.0, on_hang: str = "exit", dirpath: str = "hang"):
        self.timeout_s = float(timeout_s)
        self.on_hang = on_hang
        self.dirpath = Path(dirpath)
        self._last = time.monotonic()
        self._where = "set-up"
        self._active = False
        self._reported = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._rank = 0
        self._world = 1

    # --- progress ------------------------------------------------------------------------
    def _beat(self, where: str) -> None:
        self._last = time.monotonic()
        self._where = where
        self._reported = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._rank, self._world = trainer.global_rank, trainer.world_size
        self._beat(f"setup ({stage})")
        self._active = True
        if self._thread is None:
            _stacks_on_signal()
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.stop()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception) -> None:
        self.stop()

    def stop(self) -> None:
        """Ends the watching thread (the next stage starts a new one)."""
        self._active = False
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def on_train_start(self, trainer, pl_module) -> None:
        self._beat("training start")

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._beat(f"start of training epoch {trainer.current_epoch}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._beat(f"training batch {batch_idx} of epoch {trainer.current_epoch} started")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._beat(f"training batch {batch_idx} of epoch {trainer.current_epoch} finished")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._beat(f"end of training epoch {trainer.current_epoch}")

    def on_validation_start(self, trainer, pl_module) -> None:
        self._beat("validation start")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, *args):
        self._beat(f"validation batch {batch_idx} finished")

    def on_validation_end(self, trainer, pl_module) -> None:
        self._beat("validation end")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, *args) -> None:
        self._beat(f"test batch {batch_idx} finished")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._beat("checkpoint save")

    # --- the watching thread ---------------------------------------------------------------
    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if self._active and not self._reported and idle > self.timeout_s:
                self._reported = True
                self._on_hang(idle)

    def _on_hang(self, idle: float) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        write_rank_dump(self.dirpath, self._rank, self._world, idle, self._where)
        if self._rank == 0:
            message = self._report(idle)
        else:
            _wait_for(lambda: (self.dirpath / _SUMMARY).is_file(), _GATHER_S)
            message = f"rank {self._rank}: no progress for {idle:.0f} s; see {self.dirpath}"
        if self.on_hang == "exit":
            # The main thread is stuck: end the process from here, leaving the message where
            # the elastic agent (or torchrun) looks for the cause of a worker's failure.
            ErrorHandler().record_exception(TrainingStopped(message))
            print(f"error: {message}", file=sys.stderr, flush=True)
            os._exit(1)

    def _report(self, idle: float) -> str:
        """Rank 0: waits for every rank's file, then prints and saves one line per rank."""
        files = [self.dirpath / f"rank_{rank}.txt" for rank in range(self._world)]
        _wait_for(lambda: all(f.is_file() for f in files), _GATHER_S)
        lines = [
            f"Hang: no progress for {idle:.0f} s (timeout_s={self.timeout_s:g}); last progress "
            f"on rank 0: {self._where}.",
            f"Stacks of every thread of every rank: {self.dirpath}/rank_<N>.txt",
        ]
        for rank, file in enumerate(files):
            if not file.is_file():
                lines.append(
                    f"rank {rank}: wrote no file (dead, another node, or stuck holding the GIL)"
                )
                continue
            head = dict(
                line.split(": ", 1) for line in file.read_text().splitlines()[1:3] if ": " in line
            )
            lines.append(
                f"rank {rank}: main thread at {head.get('main thread at', '?')}; "
                f"collectives: {head.get('collectives', '?')}"
            )
        text = "\n".join(lines)
        (self.dirpath / _SUMMARY).write_text(text + "\n")
        print(text, flush=True)
        then = "the run stops" if self.on_hang == "exit" else "the run keeps waiting"
        return (
            f"no progress for {idle:.0f} s (last progress on rank 0: {self._where}); the "
            f"stacks of every rank are in {self.dirpath}, and {_SUMMARY} says where each rank "
            f"is; {then}"
        )


def _stacks_on_signal() -> None:
    with contextlib.suppress(AttributeError, ValueError, OSError):  # no such signal, or no file
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)


def _wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)


def write_rank_dump(dirpath: Path, rank: int, world: int, idle: float, where: str) -> None:
    """This process's thread stacks and recorded collectives, in `<dirpath>/rank_<N>.txt`
    (the full flight-recorder dump in `rank_<N>.collectives.json`). Its lines 2 and 3 say
    where the main thread is and which collectives are in flight."""
    collectives = flight_recorder_dump()
    if collectives is not None:
        (dirpath / f"rank_{rank}.collectives.json").write_text(
            json.dumps(collectives, indent=1, default=str)
        )
    # Written under a temporary name and renamed: rank 0 reads only complete files.
    path = dirpath / f"rank_{rank}.txt"
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as out:
        out.write(
            f"rank {rank} of {world}, pid {os.getpid()} on {socket.gethostname()}: no progress "
            f"for {idle:.1f} s; last progress: {where}\n"
            f"main thread at: {_main_thread_frame()}\n"
            f"collectives: {collective_state(collectives)}\n\n"
        )
        if collectives is not None:
            out.write("Last collectives recorded by the flight recorder:\n")
            out.write("".join(f"  {line}\n" for line in collective_lines(collectives)) + "\n")
        out.write("Python stacks, most recent call first:\n")
        out.flush()
        faulthandler.dump_traceback(out, all_threads=True)
    tmp.replace(path)


def _main_thread_frame() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown"
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _short(filename: str) -> str:
    """A path inside site-packages from the package on (torch/..., lightning/...)."""
    _, sep, inside = filename.partition("site-packages/")
    return inside if sep else filename


def flight_recorder_dump() -> dict[str, Any] | None:
    """The collectives PyTorch's flight recorder holds (TORCH_FR_BUFFER_SIZE > 0), or None."""
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) <= 0:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    # NCCL keeps its own recorder (CUDA events); gloo and the others share one.
    name = "_dump_nccl_trace" if dist.get_backend() == "nccl" else "_dump_fr_trace"
    dump = getattr(torch._C._distributed_c10d, name, None)
    if dump is None:
        return None
    try:
        return pickle.loads(dump(includeStackTraces=True))
    except RuntimeError:
        return None


def collective_state(dump: dict[str, Any] | None) -> str:
    """Which collectives of the default process group are in flight, and the last one
    completed: the rank with the highest numbers waits for the others."""
    if dump is None:
        return "not recorded (the flight recorder is off: debug.flight_recorder=2000)"
    entries = [e for e in dump.get("entries", []) if str(e.get("pg_id")) == "0"]
    done = [e["collective_seq_id"] for e in entries if e.get("retired")]
    flying = [e for e in entries if not e.get("retired")]
    last = f"last completed #{max(done)}" if done else "none completed"
    if not flying:
        return f"none in flight, {last}"
    first, newest = flying[0], flying[-1]
    numbers = f"#{first['collective_seq_id']}" + (
        f"-#{newest['collective_seq_id']}" if len(flying) > 1 else ""
    )
    return f"{numbers} {newest.get('profiling_name')} in flight{_caller(newest)}, {last}"


def collective_lines(dump: dict[str, Any], last: int = 8) -> list[str]:
    lines = []
    for entry in dump.get("entries", [])[-last:]:
        state = "completed" if entry.get("retired") else "IN FLIGHT"
        lines.append(
            f"#{entry.get('collective_seq_id')} {entry.get('profiling_name')} "
            f"sizes {entry.get('input_sizes')} {state}{_caller(entry)}"
        )
    return lines


def _caller(entry: dict[str, Any]) -> str:
    """The innermost frame outside torch.distributed: who issued the collective."""
    for frame in entry.get("frames") or []:
        filename = str(frame.get("filename", ""))
        if "torch/distributed" not in filename:
            return f" (from {frame.get('name')}, {_short(filename)}:{frame.get('line')})"
    return ""
