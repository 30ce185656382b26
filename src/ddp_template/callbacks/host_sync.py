"""Host-sync finder (CUDA): the lines that make the CPU wait for the GPU in training steps.

`.item()`, `.cpu()`, `print(tensor)`, a Python `if` on a tensor, `torch.nonzero`... each
stops the CPU until the GPU has caught up, so the next kernels are queued late and the GPU
idles. `torch.cuda.set_sync_debug_mode("warn")` makes PyTorch warn at every such call;
this callback turns it on during training steps only and reports each line once, on rank
0: the innermost frame outside torch, i.e. the line of your code (or of Lightning) that
asked for the value.
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import lightning as L
import torch

_SYNC_WARNING = "called a synchronizing CUDA operation"
_TORCH = str(Path(torch.__file__).parent)
_THIS = __file__


class HostSyncFinder(L.Callback):
    def __init__(self) -> None:
        self.found: dict[str, int] = {}
        self._show = warnings.showwarning
        self._filters = warnings.filters[:]
        self._rank_zero = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._rank_zero = trainer.is_global_zero
        self._filters = warnings.filters[:]
        # Every occurrence reaches `_record`, which counts them and prints each line once.
        warnings.filterwarnings("always", message=f".*{_SYNC_WARNING}.*")
        self._show = warnings.showwarning
        warnings.showwarning = self._record

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        warnings.filters[:] = self._filters
        if self._rank_zero:
            lines = sorted(self.found.items(), key=lambda item: -item[1])
            listed = "\n".join(f"  {count:>6} x  {where}" for where, count in lines)
            print(
                f"host syncs in training steps: {len(lines)} line(s)"
                + (f", by count:\n{listed}" if lines else ""),
                flush=True,
            )

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if _SYNC_WARNING not in str(message):
            self._show(message, category, filename, lineno, file, line)
            return
        where = _caller()
        first = where not in self.found
        self.found[where] = self.found.get(where, 0) + 1
        if first and self._rank_zero:
            print(f"host sync: {where}", flush=True)


def _caller() -> str:
    """`file:line  code` of the innermost frame outside torch and this file."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_TORCH) or frame.filename == _THIS:
            continue
        if frame.filename.endswith("warnings.py"):
            continue
        return f"{frame.filename}:{frame.lineno}  {(frame.line or '').strip()}"
    return "(inside torch)"
