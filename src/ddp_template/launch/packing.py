"""`launcher=packed`: the jobs of a sweep run side by side, each on its own share of the
machine, instead of one after another.

The machine is cut into lanes: disjoint sets of GPUs (through `CUDA_VISIBLE_DEVICES`) and CPU
cores (through the process's CPU affinity, from which each rank sizes its threads and loader
workers). Each job runs in its own process, forked from the sweep's process, on a free lane:
it composes, checks, starts its workers (each job's elastic agent picks its own rendezvous
port) and writes its own folder of the sweep, exactly as with Hydra's sequential launcher. A
job that fails, or whose process dies, fails alone; the sweep reports and exits as the
sequential one does.

The sweep's process imports torch and Lightning once, before the first job: jobs forked from
it, and the workers they fork, do not import them again. Jobs follow the workers' rule
(`launch.worker_start_method`): they are spawned instead where a fork would be unsound (a
thread in the sweep's process; GPU jobs once it counted the GPUs through the CUDA runtime).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import multiprocessing
import os
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import (
    JobReturn,
    JobStatus,
    configure_log,
    filter_overrides,
    run_job,
    setup_globals,
)
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.basecontainer import BaseContainer

from ddp_template.errors import ConfigError, UserFacingError

log = logging.getLogger(__name__)

# Thread counts a library may read from the environment: a job's share of cores decides.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# What every job imports: loaded once in the sweep's process, before the first fork.
PRELOADED_MODULES = (
    "ddp_template.config.checks",
    "ddp_template.worker.results",
    "ddp_template.build",
)


@dataclass(frozen=True)
class Lane:
    """A share of the machine that one job at a time runs on."""

    cores: tuple[int, ...]
    # GPU ids as CUDA_VISIBLE_DEVICES names them; None where the jobs train on CPUs.
    gpus: tuple[str, ...] | None

    def enter(self) -> None:
        """Confines this process (and the processes it starts) to the lane."""
        os.sched_setaffinity(0, self.cores)
        for name in THREAD_VARIABLES:
            os.environ.pop(name, None)
        if self.gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)

    def describe(self) -> str:
        cores = f"cores {','.join(map(str, self.cores))}"
        return cores if self.gpus is None else f"GPUs {','.join(self.gpus)}, {cores}"


def plan_lanes(
    jobs: object, job_devices: Sequence[int], gpus: Sequence[str] | None, cores: Sequence[int]
) -> list[Lane]:
    """Lanes for a batch of jobs needing `job_devices` devices each: GPUs when `gpus` is
    given, else CPU cores (one core per rank when `jobs` is null). Raises ConfigError for a
    request the machine cannot hold."""
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ConfigError(
            "hydra.launcher.jobs",
            jobs,
            "a whole number >= 1 of jobs at once, or null for as many as the machine holds",
            "e.g. hydra.launcher.jobs=2",
        )
    per_job = max(job_devices)
    kind = "GPUs" if gpus is not None else "CPU cores"
    units = len(gpus) if gpus is not None else len(cores)
    if per_job > units:
        raise ConfigError(
            "devices",
            per_job,
            f"at most the {units} {kind} of this machine: launcher=packed runs each job on "
            "one machine",
            f"lower devices to {units} or less, or run the sweep with launcher=slurm",
        )
    most = units // per_job
    if jobs is not None and gpus is not None and jobs > most:
        raise ConfigError(
            "hydra.launcher.jobs",
            jobs,
            f"at most {most}: each job takes {per_job} of the {units} GPUs here, and jobs "
            "side by side get disjoint GPUs",
            f"hydra.launcher.jobs={most}, or leave it null",
        )
    if jobs is not None and jobs > len(cores):
        raise ConfigError(
            "hydra.launcher.jobs",
            jobs,
            f"at most the {len(cores)} CPU cores here: jobs side by side get disjoint cores",
            f"hydra.launcher.jobs={len(cores)}, or leave it null",
        )
    count = min(jobs or most, len(job_devices))
    core_shares = _split(list(cores), count)
    return [
        Lane(
            cores=tuple(core_shares[lane]),
            gpus=None if gpus is None else tuple(gpus[lane * per_job : (lane + 1) * per_job]),
        )
        for lane in range(count)
    ]


def _split(items: list[int], parts: int) -> list[list[int]]:
    """`parts` disjoint runs of consecutive items, sizes differing by one at most."""
    size, extra = divmod(len(items), parts)
    shares, start = [], 0
    for part in range(parts):
        end = start + size + (1 if part < extra else 0)
        shares.append(items[start:end])
        start = end
    return shares


def machine_gpus() -> list[str]:
    """GPUs this process may use, by the names CUDA_VISIBLE_DEVICES gives them. Counted
    as torch counts them: through NVML where it can (forked jobs can then use CUDA), else
    through the CUDA runtime (jobs on GPUs are then spawned: `job_start_method`)."""
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [name.strip() for name in visible.split(",") if name.strip()][:count]
    return [str(index) for index in range(count)]


def job_devices(cfg: DictConfig, gpus: Sequence[str]) -> tuple[int, bool]:
    """How many devices a job asks for, and whether they are GPUs (as `resolve_and_check`
    resolves `accelerator` and `devices`; its checks then run in the job)."""
    on_gpus = cfg.accelerator in ("gpu", "cuda") or (cfg.accelerator == "auto" and bool(gpus))
    devices = cfg.devices
    if devices == "auto":
        return (len(gpus) if on_gpus else 1), on_gpus
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError("devices", devices, "a whole number >= 1 or 'auto'", "e.g. devices=1")
    return devices, on_gpus


def launch_packed(
    jobs: object,
    config: DictConfig,
    hydra_context: HydraContext,
    task_function: TaskFunction,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
) -> list[JobReturn]:
    """Runs the jobs, as many at once as there are lanes; returns them in sweep order."""
    if not sys.platform.startswith("linux"):
        _refuse(
            ConfigError(
                "launcher",
                "packed",
                "Linux: jobs are forked and confined to their cores by CPU affinity",
                "leave launcher out (jobs then run one after another)",
            )
        )
    sweep_configs = []
    for number, overrides in enumerate(job_overrides, start=initial_job_idx):
        sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = number
            sweep_config.hydra.job.num = number
            # Resolved here, once: every job writes into this sweep's folder.
            sweep_config.hydra.sweep.dir = str(config.hydra.sweep.dir)
        sweep_configs.append(sweep_config)
    gpus = machine_gpus()
    try:
        needs = [job_devices(sweep_config, gpus) for sweep_config in sweep_configs]
        lanes = plan_lanes(
            jobs,
            [devices for devices, _ in needs],
            gpus if any(on_gpus for _, on_gpus in needs) else None,
            sorted(os.sched_getaffinity(0)),
        )
    except ConfigError as err:
        _refuse(err)

    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    for module in PRELOADED_MODULES:
        importlib.import_module(module)
    log.info(f"Launching {len(sweep_configs)} jobs locally, {len(lanes)} at once")
    for lane_number, lane in enumerate(lanes):
        log.info(f"\tlane {lane_number}: {lane.describe()}")
    return _run_in_lanes(lanes, sweep_configs, hydra_context, task_function)


def _refuse(err: ConfigError) -> None:
    """Bad input to the launcher: the one-paragraph message, before any job starts."""
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


@dataclass
class _RunningJob:
    position: int
    lane: int
    process: Any
    receiver: Connection
    result: JobReturn | None = None
    received: bool = False

    def receive(self) -> None:
        """The job's return, or nothing where its process died before sending it."""
        if not self.received:
            try:
                self.result = self.receiver.recv() if self.receiver.poll() else None
            except EOFError:
                self.result = None
            self.received = True
            self.receiver.close()


def _run_in_lanes(
    lanes: list[Lane],
    sweep_configs: list[DictConfig],
    hydra_context: HydraContext,
    task_function: TaskFunction,
) -> list[JobReturn]:
    on_gpus = any(lane.gpus is not None for lane in lanes)
    start_method = job_start_method(on_gpus)
    context = (
        multiprocessing.get_context("fork")
        if start_method == "fork"
        else multiprocessing.get_context("spawn")
    )
    # A spawned job starts in a fresh interpreter: it gets Hydra's global state and the
    # task function by name (Hydra hands the launcher the undecorated function).
    task = task_function if start_method == "fork" else _task_reference(task_function)
    hydra_state = None if start_method == "fork" else _hydra_instances()
    waiting = list(enumerate(sweep_configs))
    free = list(range(len(lanes)))
    running: list[_RunningJob] = []
    returns: dict[int, JobReturn] = {}
    try:
        while waiting or running:
            while waiting and free:
                position, sweep_config = waiting.pop(0)
                lane = free.pop(0)
                overrides = " ".join(filter_overrides(sweep_config.hydra.overrides.task))
                log.info(f"\t#{sweep_config.hydra.job.num} : {overrides} (lane {lane})")
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(
                    target=_job_process,
                    args=(lanes[lane], sweep_config, hydra_context, task, hydra_state, sender),
                    name=f"job-{sweep_config.hydra.job.num}",
                )
                process.start()
                sender.close()
                running.append(_RunningJob(position, lane, process, receiver))
            # A job's return is read as soon as it is sent (a large one would fill the pipe
            # and keep the job's process from ending); the job is over when its process is.
            handles = [job.receiver for job in running if not job.received]
            wait(handles + [job.process.sentinel for job in running])
            for job in list(running):
                if not job.received and job.receiver.poll():
                    job.receive()
                if job.process.exitcode is not None:
                    job.receive()
                    job.process.join()
                    returns[job.position] = job.result or _died(
                        job.process, sweep_configs[job.position]
                    )
                    running.remove(job)
                    free.append(job.lane)
    finally:
        for job in running:
            job.process.terminate()
    return [returns[position] for position in range(len(sweep_configs))]


def job_start_method(on_gpus: bool) -> str:
    """How the jobs' processes start: the rule of the workers (`worker_start_method`)."""
    from ddp_template.launch.agent import worker_start_method

    return worker_start_method(on_cuda=on_gpus)


def _hydra_instances() -> dict[str, Any]:
    """Hydra's global state for a spawned job, less the resolvers: functions that cannot
    be pickled, registered again in the job by importing the task's module (Hydra's own
    by `setup_globals`)."""
    return {"instances": Singleton.get_state()["instances"]}


def _task_reference(task_function: TaskFunction) -> tuple[str, str]:
    return task_function.__module__, task_function.__qualname__


def _task_by_reference(reference: tuple[str, str]) -> TaskFunction:
    module, name = reference
    return inspect.unwrap(getattr(importlib.import_module(module), name))


def _job_process(
    lane: Lane,
    sweep_config: DictConfig,
    hydra_context: HydraContext,
    task: TaskFunction | tuple[str, str],
    hydra_state: dict[Any, Any] | None,
    sender: Connection,
) -> None:
    """One job, as Hydra's sequential launcher runs it, confined to its lane."""
    from ddp_template.launch.agent import own_exit_functions

    task_function = _task_by_reference(task) if isinstance(task, tuple) else task
    if hydra_state is not None:
        setup_globals()
        Singleton.set_state({**hydra_state, "omegaconf_resolvers": BaseContainer._resolvers})
    lane.enter()
    # A spawned job's interpreter runs its exit functions itself, at its end.
    with own_exit_functions() if hydra_state is None else contextlib.nullcontext():
        result = run_job(
            hydra_context=hydra_context,
            task_function=task_function,
            config=sweep_config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
    if hydra_state is not None:
        # Hydra's plugin scan ran again in this interpreter: the config's structured types
        # are new classes the sweep's process could not unpickle.
        for field in ("cfg", "hydra_cfg"):
            value = getattr(result, field, None)
            if isinstance(value, DictConfig):
                setattr(result, field, OmegaConf.create(OmegaConf.to_container(value)))
    sender.send(_portable(result))
    sender.close()


def _portable(result: JobReturn) -> JobReturn:
    """The job's return as the sweep's process can read it: an exception whose class
    cannot be rebuilt from a pickle travels as a UserFacingError of the same message."""
    if result.status == JobStatus.FAILED:
        error = result._return_value
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:
            result._return_value = UserFacingError(f"{type(error).__name__}: {error}")
    return result


def _died(process: Any, sweep_config: DictConfig) -> JobReturn:
    """The return of a job whose process ended before it could report (killed, out of
    memory, a crash)."""
    cause = f"signal {-process.exitcode}" if process.exitcode < 0 else f"code {process.exitcode}"
    result = JobReturn(overrides=list(sweep_config.hydra.overrides.task), status=JobStatus.FAILED)
    result._return_value = UserFacingError(
        f"Job {sweep_config.hydra.job.num} ended with {cause} before it finished; the other "
        "jobs of the sweep went on."
    )
    return result
