"""Errors meant for the person at the keyboard: one paragraph, no traceback."""

from __future__ import annotations

from typing import Any


class UserFacingError(Exception):
    """A problem the user can fix; printed as its message alone."""


class ConfigError(UserFacingError):
    """A config value that cannot work, found before any worker process starts."""

    def __init__(self, key: str, value: Any, allowed: str, fix: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        self.fix = fix
        super().__init__(f"{key}={value!r} is not valid: {allowed}. Fix: {fix}")

    def __reduce__(self) -> tuple:
        # Rebuilt from its parts when it crosses processes (a packed sweep's job).
        return type(self), (self.key, self.value, self.allowed, self.fix)


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
