"""`compile=true`: the model's forward compiled with torch.compile (inductor), under DDP.

Lightning wraps the LightningModule in DistributedDataParallel; the compiled function is the
module's forward, inside that wrapper. This is PyTorch's advice for DDP ("apply torch.compile to
the inner module passed to the wrapper") and what Lightning's Trainer does with a compiled
module. `nn.Module.compile()` compiles in place, so the module stays a LightningModule with the
same state_dict keys: checkpoints and the exported weights do not change. The training and
evaluation steps stay eager: logging and the torchmetrics updates would break the graph.
The first steps compile; the speed monitor keeps them out of the step times (warm-up).
"""

from __future__ import annotations

import logging

import lightning as L
import torch
from omegaconf import DictConfig

from ddp_template.errors import ConfigError


def check_compile(cfg: DictConfig) -> None:
    value = cfg.get("compile", False)
    if not isinstance(value, bool):
        raise ConfigError(
            "compile",
            value,
            "true (torch.compile the model's forward) or false",
            "compile=true or compile=false",
        )
    if value and cfg.strategy.name == "ddp_spawn":
        raise ConfigError(
            "compile",
            value,
            "not with strategy=ddp_spawn: spawning pickles the module, and a module's pickle "
            "leaves out its compiled forward, so the ranks would train uncompiled",
            "use strategy=ddp (the default for devices > 1) with compile=true",
        )


def compile_if_asked(cfg: DictConfig, module: L.LightningModule) -> None:
    if not cfg.get("compile", False):
        return
    if not torch.cuda.is_available():
        # Inductor's C++ build notes at every start that it found no CUDA: expected here.
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    module.compile()
