"""The types and ranges of every config value, checked before any worker starts.

Types come from where each value goes: the signature of the class or function a node
instantiates (`_target_`: callbacks, loggers, optimizer, scheduler, the task's module and
DataModule), `lightning.Trainer`'s own signature for `trainer.*`, and the dataclasses below
for the switches this project reads itself. They are checked as OmegaConf structured
configs, so a value of the wrong type is named with its full key. What a type cannot say
(a lower bound, a set of names) is one row of `LIMITS`. Values that only make sense
together are refused by the real objects, built once by `trial_objects.check_by_building`.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import types
import typing
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, make_dataclass
from typing import TYPE_CHECKING, Any, Literal, Union, cast

from hydra.utils import get_object
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from ddp_template.callbacks.watchdog import ON_HANG
from ddp_template.debug import DISTRIBUTED_DEBUG_LEVELS
from ddp_template.errors import ConfigError, unknown_key_error
from ddp_template.worker.comm_hooks import COMM_HOOKS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclass
class Run:
    """Top-level switches read by this project (the Trainer's come from its signature).

    These dataclasses hold types only: every default is in conf/ (here conf/train.yaml),
    the one place a default is written."""

    seed: int = MISSING
    ckpt_path: str | None = MISSING
    resume: bool = MISSING
    max_restarts: int = MISSING
    restart_from_scratch: bool = MISSING
    test: bool = MISSING
    optimized_metric: str = MISSING
    compile: bool = MISSING


@dataclass
class Strategy:
    """`strategy=`: turned into Lightning's DDPStrategy by `build.build_strategy`."""

    name: str = MISSING
    process_group_backend: str | None = MISSING
    timeout: float = MISSING
    bucket_cap_mb: float | None = MISSING
    gradient_as_bucket_view: bool = MISSING
    forward_sync_buffers: bool = MISSING
    static_graph: bool = MISSING
    find_unused_parameters: bool = MISSING
    comm_hook: str = MISSING
    powersgd_rank: int = MISSING
    powersgd_start_iter: int = MISSING


@dataclass
class ShardedStrategy:
    """`strategy=fsdp`: turned into `worker.sharding.ShardedStrategy` by `build.build_strategy`."""

    name: str = MISSING
    process_group_backend: str | None = MISSING
    timeout: float = MISSING
    wrap: list[str] | None = MISSING
    reshard_after_forward: bool = MISSING
    activation_checkpointing: bool = MISSING
    cpu_offload: bool = MISSING
    async_save: bool = MISSING
    comm_hook: str = MISSING


@dataclass
class Debug:
    flight_recorder: int = MISSING
    distributed_debug: str | None = MISSING


@dataclass
class Network:
    """`network.*`: how the nodes of a job find each other (node_agreement, network)."""

    interface: str | None = MISSING
    timeout_s: float = MISSING
    node_rank: int | None = MISSING
    master_addr: str | None = MISSING
    master_port: int = MISSING
    job_id: str | None = MISSING


@dataclass
class Benchmark:
    warmup_steps: int = MISSING
    steps: int = MISSING


@dataclass(frozen=True)
class Limit:
    """What a key allows beyond its type: bounds (`above`: the lower one strictly), or names."""

    minimum: float | None = None
    above: bool = False
    maximum: float | None = None
    # A live view such as a registry's keys() allows what is added to it later.
    names: Collection[Any] = ()
    why: str = ""


LIMITS: dict[str, Limit] = {
    # lightning's seed_everything refuses others, in every worker.
    "seed": Limit(0, maximum=2**32 - 1, why="the seeds NumPy accepts"),
    "num_nodes": Limit(1),
    "max_restarts": Limit(0),
    "strategy.name": Limit(names=("auto", "ddp", "ddp_spawn", "fsdp")),
    "strategy.process_group_backend": Limit(names=(None, "gloo", "nccl", "mpi")),
    "strategy.timeout": Limit(0, above=True, why="seconds a collective may wait"),
    "strategy.bucket_cap_mb": Limit(0, above=True, why="MiB, or null for PyTorch's default"),
    "strategy.comm_hook": Limit(names=COMM_HOOKS.keys(), why="PyTorch's DDP communication hooks"),
    "strategy.powersgd_rank": Limit(1),
    "strategy.powersgd_start_iter": Limit(2, why="PyTorch requires it with error feedback"),
    # Lightning accepts these in the Trainer and fails (or divides by zero) mid-run.
    "trainer.accumulate_grad_batches": Limit(1),
    "trainer.log_every_n_steps": Limit(1),
    "trainer.check_val_every_n_epoch": Limit(1),
    "trainer.num_sanity_val_steps": Limit(-1, why="-1 runs the whole validation set"),
    "trainer.max_steps": Limit(-1, why="-1: no limit"),
    "trainer.limit_train_batches": Limit(
        0, above=True, why="a fraction of the batches or a number of them; 0 trains nothing"
    ),
    "trainer.min_steps": Limit(0),
    "trainer.min_epochs": Limit(0),
    "trainer.gradient_clip_val": Limit(0),
    "trainer.reload_dataloaders_every_n_epochs": Limit(0),
    "data.batch_size": Limit(1),
    "data.num_workers": Limit(0),
    "data.prefetch_factor": Limit(1),
    "network.node_rank": Limit(0, why="0 for the node that hosts the rendezvous"),
    "network.master_port": Limit(1, why="a TCP port"),
    "network.timeout_s": Limit(
        0, above=True, why="seconds each rank waits for the others at start"
    ),
    "benchmark.warmup_steps": Limit(0),
    "benchmark.steps": Limit(1),
    "debug.flight_recorder": Limit(0),
    "debug.distributed_debug": Limit(names=(None, *DISTRIBUTED_DEBUG_LEVELS)),
    "callbacks.sync_check.every_n_steps": Limit(1),
    "callbacks.hang_watchdog.timeout_s": Limit(0, above=True, why="seconds without progress"),
    "callbacks.hang_watchdog.on_hang": Limit(names=tuple(ON_HANG)),
    "callbacks.profiler.wait": Limit(0),
    "callbacks.profiler.warmup": Limit(0),
    "callbacks.profiler.repeat": Limit(0),
    "callbacks.profiler.active": Limit(1, why="the profiler records nothing without them"),
    # Lightning takes any number: a negative one stops at the first round without
    # improvement, as 0 and 1 do, and was surely meant otherwise.
    "callbacks.early_stopping.patience": Limit(
        0, why="validation rounds without improvement before training stops"
    ),
    "callbacks.early_stopping.min_delta": Limit(0, why="the smallest change that counts"),
}

# Trainer arguments that are top-level switches or built from their own config groups.
TRAINER_ARGS_ELSEWHERE = {
    "accelerator",
    "strategy",
    "devices",
    "num_nodes",
    "precision",
    "logger",
    "callbacks",
    "sync_batchnorm",
    "default_root_dir",
}
_TRAINER = "lightning.Trainer"
_HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


def check_types_and_ranges(cfg: DictConfig) -> None:
    """Every value against its schema, then against `LIMITS`."""
    values = _resolved(cfg)
    for path, schema, node in _schemas(values):
        _check_node(path, schema, node)
    tree = OmegaConf.create(values)
    for key, limit in LIMITS.items():
        value = OmegaConf.select(tree, key, default=MISSING)
        if value is not MISSING:
            _check_limit(key, value, limit)


def parameter_default(target: str, name: str) -> Any:
    """The default of a parameter of `target` (MISSING when it has none)."""
    parameter = inspect.signature(_callable(target)).parameters.get(name)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return MISSING
    return parameter.default


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    try:
        # A DictConfig becomes a dict; OmegaConf types the result for any node.
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        return cast("dict[str, Any]", values)
    except MissingMandatoryValue as err:
        key = err.full_key or str(err.key)
        raise ConfigError(
            key,
            "???",
            "a value of your own: the config has no default for it (???)",
            f"add {key}=<value> to the command line",
        ) from None
    except OmegaConfBaseException as err:
        key = err.full_key or "config"
        raise ConfigError(
            key, OmegaConf.select(cfg, key, throw_on_missing=False), _first_line(err), f"set {key}"
        ) from None


def _schemas(values: dict[str, Any]) -> Iterator[tuple[str, type, dict[str, Any]]]:
    """(key prefix, schema, values) for every part of the config that has one."""
    yield "", Run, {key: values[key] for key in _fields(Run) if key in values}
    trainer = signature_schema(_TRAINER)
    switches = {"num_nodes", "precision", "sync_batchnorm"}
    yield "", trainer, {key: values[key] for key in switches if key in values}
    for key in set(values.get("trainer") or {}) & TRAINER_ARGS_ELSEWHERE:
        raise ConfigError(
            f"trainer.{key}", values["trainer"][key], "set as a top-level switch", f"use {key}=..."
        )
    yield "trainer", trainer, values.get("trainer") or {}
    sharded = values["strategy"].get("name") == "fsdp"
    yield "strategy", ShardedStrategy if sharded else Strategy, values["strategy"]
    for key, schema in (("debug", Debug), ("benchmark", Benchmark), ("network", Network)):
        if values.get(key):
            yield key, schema, {k: v for k, v in values[key].items() if k in _fields(schema)}
    task = values.get("task") or {}
    datamodule = (task.get("datamodule") or {}).get("_target_")
    if datamodule:
        yield "data", signature_schema(datamodule), values.get("data") or {}
    yield from _instantiated(values, "")


def _instantiated(node: Any, path: str) -> Iterator[tuple[str, type, dict[str, Any]]]:
    """Every node with a `_target_`, checked against the target's signature."""
    if not isinstance(node, dict):
        return
    target = node.get("_target_")
    if isinstance(target, str) and path != "task.datamodule":
        try:
            schema = signature_schema(target)
        except (ImportError, AttributeError, ValueError) as err:
            fix = "check the spelling: a module path and a name in it"
            raise ConfigError(
                f"{path}._target_", target, f"an importable name ({err})", fix
            ) from None
        yield path, schema, node
    for key, child in node.items():
        yield from _instantiated(child, f"{path}.{key}" if path else key)


def _fields(schema: type) -> list[str]:
    return list(cast("type[DataclassInstance]", schema).__dataclass_fields__)


@functools.cache
def _hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


@functools.cache
def signature_schema(target: str) -> type:
    """A structured config of `target`'s keyword parameters, typed from its annotations.
    Closed (unknown keys refused) unless the target takes **kwargs."""
    function = _callable(target)
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # annotations naming what cannot be imported here: checked when built
        hints = {}
    fields, open_ended, choices = [], False, {}
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            open_ended = True
        elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL and name != "self":
            kind, names = _field_type(hints.get(name, Any), parameter.default is None)
            fields.append((name, kind, field(default=MISSING)))
            if names:
                choices[name] = names
    # Any: the class gets three attributes of ours, read back with getattr.
    schema: Any = make_dataclass(f"{target.rsplit('.', 1)[-1]}Schema", fields)
    schema.open_ended, schema.choices, schema.target = open_ended, choices, target
    return schema


def _callable(target: str) -> Callable:
    target_object = get_object(target)
    return target_object.__init__ if inspect.isclass(target_object) else target_object


_PRIMITIVES = (bool, int, float, str)


def _field_type(annotation: Any, nullable: bool) -> tuple[Any, tuple]:
    """OmegaConf's type for a parameter, and the names a `Literal` allows (else ())."""
    union = typing.get_origin(annotation) in (Union, types.UnionType)
    members = typing.get_args(annotation) if union else (annotation,)
    kinds: list[type] = []
    names: list[Any] = []
    for member in members:
        if member is type(None):
            nullable = True
        elif typing.get_origin(member) is Literal:
            names += typing.get_args(member)
            kinds += [type(value) for value in typing.get_args(member)]
        elif member in _PRIMITIVES:
            kinds.append(member)
        elif member is Any or typing.get_origin(member) or member in (list, dict, tuple):
            # Containers cannot be a member of an OmegaConf Union: checked when built.
            return Any, ()
        # Any other class is reached through a `_target_` node, checked by its own schema.
    if not kinds:
        return Any, ()
    # A plain `str` (or int) member allows every value of that type, not only the names.
    plain = [m for m in members if m in _PRIMITIVES]
    names = [n for n in names if type(n) not in plain] + [None] * (nullable and bool(names))
    names += [True, False] * (bool in plain and bool(names))
    kind: Any = Union[tuple(dict.fromkeys(kinds))]  # noqa: UP007 - a Union built at run time
    return (kind | None if nullable else kind), tuple(names)


def _check_node(path: str, schema: type, node: dict[str, Any]) -> None:
    values = {
        key: value
        for key, value in node.items()
        if key not in _HYDRA_KEYS and not (isinstance(value, dict) and "_target_" in value)
    }
    structured = OmegaConf.structured(schema)
    OmegaConf.set_struct(structured, not getattr(schema, "open_ended", False))
    try:
        OmegaConf.merge(structured, values)
    except (ValidationError, ConfigKeyError) as err:
        name = str(err.full_key).split(".")[0]
        key = f"{path}.{name}" if path else name
        raise _type_error(key, isinstance(err, ConfigKeyError), schema, values[name]) from None
    for name, value in values.items():
        # OmegaConf reads "yes", "on" and 1 as true; the libraries would get them as they are.
        if _only_bool(_hints(schema).get(name)) and not isinstance(value, (bool, type(None))):
            raise _type_error(f"{path}.{name}" if path else name, False, schema, value)
        names = getattr(schema, "choices", {}).get(name, ())
        if names and type(value) in {type(n) for n in names} - {bool} and value not in names:
            raise _choice_error(f"{path}.{name}" if path else name, value, names)


def _only_bool(hint: Any) -> bool:
    union = typing.get_origin(hint) in (Union, types.UnionType)
    return set(typing.get_args(hint) if union else [hint]) - {type(None)} == {bool}


def _type_error(key: str, unknown: bool, schema: type, value: Any) -> ConfigError:
    name = key.rsplit(".", 1)[-1]
    target = getattr(schema, "target", None)
    if unknown:
        return unknown_key_error(key, value, _fields(schema), target or "this part of the config")
    hint = _hints(schema)[name]
    default = parameter_default(target, name) if target else train_config_default(key)
    fix = (
        f"e.g. {key}={as_override(default)}"
        if default is not MISSING and _is_plain(default)
        else f"set {key}"
    )
    return ConfigError(key, value, describe_type(hint), fix)


def train_config_default(key: str) -> Any:
    """The value conf/train.yaml itself gives `key` (MISSING where it gives none, or one
    from another file or an interpolation): the schema's dataclasses hold no defaults."""
    from ddp_template.project import CONFIG_DIR

    value = OmegaConf.select(
        OmegaConf.load(f"{CONFIG_DIR}/train.yaml"), key, default=MISSING, throw_on_missing=False
    )
    return MISSING if isinstance(value, str) and "${" in value else value


def _choice_error(key: str, value: Any, names: Collection[Any]) -> ConfigError:
    listed = ", ".join(dict.fromkeys(as_override(n) for n in names))
    return ConfigError(
        key, value, f"one of {listed}", f"e.g. {key}={as_override(next(iter(names)))}"
    )


def _check_limit(key: str, value: Any, limit: Limit) -> None:
    why = f" ({limit.why})" if limit.why else ""
    if limit.names:
        if value not in limit.names:
            raise _choice_error(key, value, limit.names)
        return
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return
    low, high = limit.minimum, limit.maximum
    assert low is not None  # every Limit without names has a minimum
    if (value <= low) if limit.above else (value < low):
        allowed = f"{'>' if limit.above else '>='} {as_override(low)}{why}"
        if high is not None:
            allowed = f"from {as_override(low)} to {as_override(high)}{why}"
        example = low + 1 if limit.above else low
        raise ConfigError(key, value, allowed, f"e.g. {key}={as_override(example)}")
    if high is not None and float(value) > float(high):
        allowed = f"from {as_override(low)} to {as_override(high)}{why}"
        raise ConfigError(key, value, allowed, f"e.g. {key}={as_override(high)}")


def describe_type(hint: Any) -> str:
    """`Optional[int]` -> "a whole number or null"."""
    words = {
        bool: "true or false",
        int: "a whole number",
        float: "a number",
        str: "a text",
        type(None): "null",
    }
    members = (
        typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else [hint]
    )
    return " or ".join(
        words.get(member, getattr(member, "__name__", str(member))) for member in members
    )


def as_override(value: Any) -> str:
    """A value as it is typed on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, _PRIMITIVES)


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
