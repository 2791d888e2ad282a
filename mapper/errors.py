"""The project's error types.

Adapters translate foreign errors (NVML, gRPC, paho, SQLite) into these at their boundary, once.
Loops decide what to do from the type alone:

* ``TransientError``: try again later (capped backoff); ``retry_after_s`` is a hint.
* ``PermanentError``: report it and stop retrying that action until the input changes.
* ``PartlyRefusedError``: a write of several items refused some of them (``refused``: their positions) and did
  the rest.
* ``UnsupportedError``: the capability is absent on this GPU/driver; mark it absent and log once.
* ``ReadBackMismatchError``: a setter reported success but the GPU reads another value; keep the value pending
  and try again after a backoff.

Messages name what failed: the GPU (by UUID), the call and the value.
"""

from __future__ import annotations

from collections.abc import Iterable


class MapperError(Exception):
    """Base class of every error the project raises on purpose."""

    #: A short reason in the KubeEdge twin charset (``[a-zA-Z0-9-_.,:/@#]``), e.g. ``out-of-range``.
    reason: str = "error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class TransientError(MapperError):
    """Worth retrying: the same call may succeed later."""

    reason = "transient"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.retry_after_s = retry_after_s


class PermanentError(MapperError):
    """Retrying the same call with the same input will fail the same way."""

    reason = "failed"


class PartlyRefusedError(PermanentError):
    """A write of several items refused some of them and did the rest: ``refused`` holds the positions (in the
    items given) of the refused ones, so the caller counts the others as done."""

    def __init__(self, message: str, *, refused: Iterable[int], reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.refused = tuple(sorted(set(refused)))


class UnsupportedError(PermanentError):
    """The GPU, its driver or the binding lacks the capability (NVML NotSupported / FunctionNotFound)."""

    reason = "not-supported"


class NoPermissionError(PermanentError):
    """The process lacks the privilege (NVML NoPermission: setters need root)."""

    reason = "no-permission"


class InvalidValueError(PermanentError):
    """A value was refused: wrong type, out of range, not in the supported list, ...

    ``reason`` is one of a small set of twin-safe codes (see ``mapper.shared.model.REJECT_REASONS``).
    """

    reason = "invalid"


class ReadBackMismatchError(PermanentError):
    """A setter reported success but reading the value back right after shows another one (a power limit that
    did not take, a devfreq range or power mode the GPU reads otherwise). The reconciler keeps the value pending
    and retries after a backoff; other callers see a ``PermanentError``, as before this had a type."""

    reason = "read-back-mismatch"


class GpuLostError(TransientError):
    """The GPU fell off the bus (NVML GpuIsLost, XID 79) or its handle vanished. Needs a reboot in practice."""

    reason = "gpu-lost"


class NotFoundError(PermanentError):
    """A GPU (by UUID), a device or a model that is not here."""

    reason = "not-found"


class ConfigError(MapperError):
    """Bad configuration; the message names the key path (``policies.thermalThrottling.maxTemp``)."""

    reason = "bad-config"


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages: a refusal names what was wrong without
    carrying a huge input back into the log (and an integer too long to print is described, not printed)."""
    if isinstance(value, int) and value.bit_length() > 4 * limit:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
