"""What the tests share: run `python train.py` as a real subprocess, the way users do,
compose the config in-process, read a run's results.

Every run and every composed config trains on the CPU unless the test says otherwise
(`accelerator=...` among its overrides): the same suite then passes on machines with and
without GPUs.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
# What the tests plant in runs (probes, faults) and start as scripts.
HELPERS = TESTS / "helpers"
sys.path.insert(0, str(HELPERS))

# Pins the CPU: the tests check CPU behaviour (gloo, host memory, bf16 for 16-mixed).
CPU = "accelerator=cpu"

# Small, quick runs: a few batches, no per-epoch noise.
FAST = [
    CPU,
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
    "logger=none",
]

# Two epochs of FIRST_EPOCH_STEPS steps: last.prev.ckpt is the end of epoch 1, last.ckpt
# the end of epoch 2.
TWO_EPOCHS = [
    *[o for o in FAST if not o.startswith(("trainer.max_epochs", "trainer.limit_train"))],
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=2",
]
FIRST_EPOCH_STEPS = 2


def interrupt_after_first_epoch(job: Path) -> None:
    """The state a job killed during its second epoch leaves: the first epoch's checkpoint
    as last.ckpt, no results."""
    (job / "results.json").unlink()
    checkpoints = job / "checkpoints"
    (checkpoints / "last.prev.ckpt").replace(checkpoints / "last.ckpt")


def on_cpu_unless_told(overrides: tuple[str, ...] | list[str]) -> list[str]:
    """The overrides, plus `accelerator=cpu` when they name no accelerator."""
    if any(o.lstrip("+~").startswith("accelerator=") for o in overrides):
        return list(overrides)
    return [*overrides, CPU]


def train(
    *overrides: str, cwd: Path, timeout: float = 600, check: bool = True, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`python train.py <overrides>` in `cwd`, to its end; forked from the prestarted
    interpreter (helpers/prestarted.py) when the environment is the one it started with,
    unless `fresh`: a new interpreter, for tests of what a process started from the shell
    is (its command line, what it inherits)."""
    overrides = tuple(on_cpu_unless_told(overrides))
    env = subprocess_env()
    command = [sys.executable, str(ROOT / "train.py"), *overrides]
    server = None if fresh else _prestarted(env)
    if server is not None:
        proc = server.run(command, list(overrides), cwd, env, timeout)
    else:
        proc = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train.py {' '.join(overrides)} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-5000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
        )
    return proc


# Variables that differ between runs without changing what a library does as it loads.
_PER_RUN = ("PYTEST_CURRENT_TEST",)


class Prestarted:
    """The client of one prestarted interpreter (helpers/prestarted.py), started with `env`."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.folder = Path(tempfile.mkdtemp(prefix="prestarted-"))
        self.socket = str(self.folder / "socket")
        self.process = subprocess.Popen(
            [sys.executable, str(HELPERS / "prestarted.py"), self.socket],
            env=env,
            cwd=self.folder,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.process.stdout.readline() if self.process.stdout else ""
        if not ready.startswith("ready "):
            raise RuntimeError(f"the prestarted interpreter did not start: {ready!r}")
        # Its environment once the project was imported: what the libraries set as they load.
        self.loaded_env: dict[str, str] = json.loads(ready.split(" ", 1)[1])
        atexit.register(self.close)

    def serves(self, env: dict[str, str]) -> bool:
        """A run in `env` is the same here as in a fresh interpreter: `env` is the one this
        one started in, but for variables that differ run to run and those a library sets
        as it loads (this test process imported it too), at the same value."""
        if self.process.poll() is not None:
            return False
        start, run = _per_run(self.env), _per_run(env)
        return all(
            start.get(key) == run.get(key)
            or (key not in start and run[key] == self.loaded_env.get(key))
            for key in set(start) | set(run)
        )

    def run(
        self, command: list[str], args: list[str], cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        request = json.dumps({"args": args, "cwd": str(cwd), "env": env}).encode()
        with (
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
            socket.socket(socket.AF_UNIX) as connection,
        ):
            connection.connect(self.socket)
            message = struct.pack("!Q", len(request)) + request
            socket.send_fds(connection, [message], [out.fileno(), err.fileno()])
            replies = connection.makefile()
            pid = json.loads(replies.readline())["pid"]
            connection.settimeout(timeout)
            ended = False
            try:
                code = json.loads(replies.readline())["returncode"]
                ended = True
            except TimeoutError:
                raise subprocess.TimeoutExpired(command, timeout) from None
            finally:
                if not ended:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            stdout, stderr = (_text(f) for f in (out, err))
        return subprocess.CompletedProcess(command, code, stdout, stderr)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _text(file) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


_SERVER: list[Prestarted] = []


def _prestarted(env: dict[str, str]) -> Prestarted | None:
    """The prestarted interpreter for a run in `env`, started on first use; None when the
    run's environment differs from the one it started with (`DDP_TEMPLATE_TESTS_FORK=0`:
    never, every run a fresh interpreter)."""
    if os.environ.get("DDP_TEMPLATE_TESTS_FORK", "1") == "0":
        return None
    if not _SERVER:
        _SERVER.append(Prestarted(_BASE_ENV))
    server = _SERVER[0]
    return server if server.serves(env) else None


def _per_run(env: dict[str, str]) -> dict[str, str]:
    """The environment less what differs from run to run without changing how a library
    loads (`_PER_RUN`)."""
    return {k: v for k, v in env.items() if k not in _PER_RUN}


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts: the test helpers importable (faults,
    probes), kept before a PYTHONPATH set by the caller (a copy of the project)."""
    path = os.pathsep.join(filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def start(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, **popen: object
) -> subprocess.Popen:
    """Starts a command (train.py, torchrun) in the background, its output captured."""
    return subprocess.Popen(
        args,
        cwd=cwd,
        env=subprocess_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def probes(run_dir: Path) -> list[dict]:
    files = sorted((run_dir / "probe").glob("rank_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(f.read_text()) for f in files]


def compose_train(*overrides: str):
    """The training config as Hydra composes it, in this process (no job folder); on the
    CPU unless the overrides name an accelerator."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from ddp_template.config import resolvers
    from ddp_template.train import CONFIG_DIR

    resolvers.register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=on_cpu_unless_told(overrides))
    with open_dict(cfg):
        cfg.paths.output_dir = "unused"
    return cfg


# The environment of the suite's runs before any test changes it: the prestarted
# interpreter starts in it and serves the runs in it (`Prestarted.serves`).
_BASE_ENV = subprocess_env()


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()
