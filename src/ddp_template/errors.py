"""Errors meant for the person at the keyboard: one paragraph, no traceback."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any


class UserFacingError(Exception):
    """A problem the user can fix; printed as its message alone."""


class ConfigError(UserFacingError):
    """A config value that cannot work, found before any worker process starts."""

    def __init__(self, key: str, value: Any, allowed: str, fix: str) -> None:
        self.key = key
        self.value = value
        # One paragraph, however many lines a library's message had.
        allowed = " ".join(str(allowed).split()).rstrip(".")
        self.allowed = allowed
        self.fix = fix
        super().__init__(f"{key}={value!r} is not valid: {allowed}. Fix: {fix}")

    def __reduce__(self) -> tuple:
        # Rebuilt from its parts when it crosses processes (a packed sweep's job).
        return type(self), (self.key, self.value, self.allowed, self.fix)


def refusal_as_config_error(
    error: BaseException, values: Mapping[str, Any], node: str, fix: Mapping[str, str]
) -> ConfigError:
    """A library's refusal (ValueError, MisconfigurationException, ...) of the values of one
    config node (`values`: full key -> value) as a ConfigError about the key it concerns:
    the first key the message names, else the first whose value it quotes, else the node.
    `fix` gives the remedy per key (a default), else the message is the guide."""
    cause = error
    # Hydra wraps the library's exception; its message repeats the whole call.
    while cause.__cause__ is not None and type(cause).__name__ == "InstantiationException":
        cause = cause.__cause__
    message = f"{type(cause).__name__}: {cause}"
    unexpected = re.search(r"unexpected keyword argument '(\w+)'", message)
    if unexpected:
        for key in values:
            parent, _, name = key.rpartition(".")
            if name == unexpected.group(1):
                siblings = [k.rpartition(".")[2] for k in values if k.rpartition(".")[0] == parent]
                where = message.split(" got ", 1)[0].split(": ", 1)[-1]
                return unknown_key_error(
                    key, values[key], [s for s in siblings if s != name], where
                )
    key = _named_key(message, values) or node
    value = values.get(key, "...")
    remedy = fix.get(key) or f"change {key} to a value allowed there"
    return ConfigError(key, value, message, remedy)


def unknown_key_error(key: str, value: Any, known: Iterable[str], where: str) -> ConfigError:
    """A key that `where` (a class, a function, a part of the config) does not take: most
    often a typo, so the fix is the closest key it does take, else the list of them."""
    parent, _, name = key.rpartition(".")
    known = sorted(known)
    prefix = f"{parent}." if parent else ""
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return ConfigError(
            key,
            value,
            f"a key of {where}, and {name} is none (did you mean {prefix}{close[0]}?)",
            f"{prefix}{close[0]}={value}",
        )
    listed = ", ".join(known) if len(known) <= 15 else f"{len(known)} keys, see {where}"
    return ConfigError(
        key,
        value,
        f"a key of {where}, and {name} is none (its keys: {listed})",
        f"remove {key} (it is unknown), or use one of those keys",
    )


def _named_key(message: str, values: Mapping[str, Any]) -> str | None:
    for key in values:
        name = key.rsplit(".", 1)[-1]
        if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message):
            return key
    for key, value in values.items():
        quoted = str(value)
        plain = isinstance(value, (int, float, str)) and not isinstance(value, bool)
        if (
            plain
            and len(quoted) > 1
            and re.search(rf"(?<![\w.-]){re.escape(quoted)}(?![\w.])", message)
        ):
            return key
    return None


class WorkerFailed(UserFacingError):
    """A worker process of the job failed; the message names the rank and its log, and
    `details` holds that rank's traceback (shown once, above the message)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.details)


class TrainingStopped(UserFacingError):
    """A worker found a fault during training (ranks out of sync, a hang, parameters
    without a gradient) and stopped the run; its message is the diagnosis."""
