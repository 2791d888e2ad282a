"""What KubeEdge's mapper framework writes, spelled once (pure): a value as text, a time as text, the http form
body, the mqtt text message; and a ``PushSample`` as the bytes the push buffer keeps.

The framework turns every value into a string (floats in shortest decimal form: ``182.6``) and writes times as
``YYYY-MM-DD HH:MM:SS`` (whole seconds, the process's local time zone: set ``TZ``; a plain container is UTC).
Ours are the sample's own time, not the time of the write (docs/push.md).
"""

from __future__ import annotations

import email.utils
import json
import math
import time
from decimal import Decimal
from typing import Any

from mapper.errors import PermanentError, TransientError
from mapper.net.httpclient import HttpResponse
from mapper.shared.model import Value
from mapper.shared.push import PushSample

#: The text time format of the framework (Go's ``2006-01-02 15:04:05``).
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def value_text(value: Value) -> str:
    """A sample value as the framework's text: booleans ``true``/``false``, integers as they are, floats in the
    shortest decimal that reads back the same (never an exponent: ``1e+16`` is ``10000000000000000``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        text = repr(value)
        if "e" in text or "E" in text:
            text = format(Decimal(text), "f")
        return text[:-2] if text.endswith(".0") else text
    return str(value)


def number_of(value: Value) -> float | None:
    """The value as a number, where it is one (a boolean is 1 or 0); None for text."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        return float(value)
    return None


def time_text(ts_ms: int) -> str:
    """``YYYY-MM-DD HH:MM:SS`` of ``ts_ms`` in the process's local time zone (``TZ``), whole seconds."""
    return time.strftime(TIME_FORMAT, time.localtime(ts_ms // 1000))


def http_body(sample: PushSample) -> bytes:
    """The framework's http body: ``<property>=<value>&time=<YYYY-MM-DD HH:MM:SS>``, not URL-encoded (a form
    parser reads the raw space of the time as a space)."""
    return f"{sample.property}={sample.value}&time={time_text(sample.ts_ms)}".encode()


def mqtt_text(sample: PushSample, topic: str) -> bytes:
    """The framework's mqtt message: ``time is <YYYY-MM-DD HH:MM:SS>  <topic>: <value>`` (two blanks)."""
    return f"time is {time_text(sample.ts_ms)}  {topic}: {sample.value}".encode()


# --------------------------------------------------------------------------------------------------
# A sample in the push buffer
# --------------------------------------------------------------------------------------------------

_FIELDS = ("namespace", "device", "property", "value", "ts_ms", "kind", "number", "unit", "counter", "uuid", "node")


def encode_sample(sample: PushSample) -> bytes:
    """A sample as the push buffer stores it: a compact JSON list of its fields, in ``_FIELDS`` order."""
    return json.dumps([getattr(sample, f) for f in _FIELDS], separators=(",", ":"), allow_nan=True).encode()


def decode_sample(payload: bytes) -> PushSample:
    """What ``encode_sample`` wrote; ``ValueError`` naming the fault for anything else."""
    try:
        doc: Any = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"a stored push sample is not JSON: {exc}") from None
    if not isinstance(doc, list) or len(doc) != len(_FIELDS):
        raise ValueError(f"a stored push sample has {len(doc) if isinstance(doc, list) else 'no'} fields")
    ns, device, prop, value, ts_ms, kind, number, unit, counter, uuid, node = doc
    if not all(isinstance(x, str) for x in (ns, device, prop, value, kind, unit, uuid, node)):
        raise ValueError("a stored push sample has a field of the wrong type")
    if isinstance(ts_ms, bool) or not isinstance(ts_ms, int) or not isinstance(counter, bool):
        raise ValueError("a stored push sample has a field of the wrong type")
    if number is not None and (isinstance(number, bool) or not isinstance(number, int | float)):
        raise ValueError("a stored push sample has a number of the wrong type")
    return PushSample(
        namespace=ns,
        device=device,
        property=prop,
        value=value,
        ts_ms=ts_ms,
        kind=kind,
        number=None if number is None else float(number),
        unit=unit,
        counter=counter,
        uuid=uuid,
        node=node,
    )


def retry_after_s(value: str | None, now_s: float | None = None) -> float | None:
    """An HTTP ``Retry-After`` (seconds, or an HTTP date) as seconds from now; None when absent or unreadable."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    now = time.time() if now_s is None else now_s
    return max(0.0, when.timestamp() - now)


#: Statuses after which the same request may succeed later: a timeout, too early, too many requests, any 5xx.
RETRYABLE = frozenset({408, 425, 429, *range(500, 600)})


def check_answer(answer: HttpResponse, where: str, retryable: frozenset[int] = RETRYABLE) -> None:
    """Nothing for a 2xx; ``TransientError`` for a status in ``retryable`` (``Retry-After`` as its
    ``retry_after_s``); ``PermanentError`` for any other, naming ``where`` and the status."""
    status = answer.status
    if 200 <= status < 300:
        return
    text = answer.body[:200].decode("utf-8", "replace").strip()
    detail = f"{where} answered {status}" + (f": {text}" if text else "")
    if status in retryable:
        wait = retry_after_s(answer.headers.get("retry-after"))
        raise TransientError(detail, retry_after_s=wait if wait is not None else 1.0, reason=f"http-{status}")
    raise PermanentError(detail, reason=f"http-{status}")
