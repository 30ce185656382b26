"""torch.profiler over a few training steps of every rank, traces for TensorBoard and Chrome.

The schedule skips `wait` steps, warms up for `warmup` steps (recorded, then discarded:
the profiler's own start-up cost) and records `active` steps, `repeat` times (0: until
training ends). Each rank writes `<dirpath>/rank_<N>.<time>.pt.trace.json`: open it in
chrome://tracing or https://ui.perfetto.dev, or point TensorBoard at the folder
(`tensorboard --logdir <dirpath>`, with the torch-tb-profiler plugin). Rank 0 also prints
the operators that took the most time in its recorded steps.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler


class TraceProfiler(L.Callback):
    def __init__(
        self,
        dirpath: str = "profiler",
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        row_limit: int = 12,
    ) -> None:
        self.dirpath = Path(dirpath)
        self.schedule = {"wait": wait, "warmup": warmup, "active": active, "repeat": repeat}
        self.options = {
            "record_shapes": record_shapes,
            "profile_memory": profile_memory,
            "with_stack": with_stack,
        }
        self.row_limit = row_limit
        self._profiler: profile | None = None
        self.traces_written = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        activities = [ProfilerActivity.CPU]
        if pl_module.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        write_trace = tensorboard_trace_handler(
            str(self.dirpath), worker_name=f"rank_{trainer.global_rank}"
        )

        def on_trace_ready(prof: profile) -> None:
            write_trace(prof)
            self.traces_written += 1
            if trainer.is_global_zero:
                self._print_top_operators(prof, pl_module.device.type == "cuda")

        self._profiler = profile(
            activities=activities,
            schedule=schedule(**self.schedule),
            on_trace_ready=on_trace_ready,
            **self.options,
        )
        self._profiler.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._profiler is None:
            return
        self._profiler.stop()
        self._profiler = None
        if not self.traces_written and trainer.is_global_zero:
            skipped = self.schedule["wait"] + self.schedule["warmup"]
            print(
                f"profiler: training ended before a recorded step (the first {skipped} are "
                "skipped or warm-up): lower callbacks.profiler.wait and .warmup, or train longer",
                flush=True,
            )

    def _print_top_operators(self, prof: profile, cuda: bool) -> None:
        sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
        print(
            f"profiler: {self.schedule['active']} step(s) recorded, traces in {self.dirpath}; "
            f"rank 0's operators by {sort_by}:\n{table}",
            flush=True,
        )
