"""``dbMethod.TDEngine``: refused, with a reason, never ignored.

KubeEdge's framework writes through TDengine's REST interface (taosAdapter, ``/rest/sql``): a super table per
device, a sub-table per property. TDengine is not packaged for Debian, so there is no real server to test a
writer against here, and a writer checked only against our own reading of its REST interface could lose a user's
data without anyone noticing (the framework's own table names, with a ``/`` in an unquoted identifier, are likely
refused by TDengine itself). So ``make_writer`` refuses: the property's other destinations go on, and the reason
reaches the Device's ``desired_status`` and the logs (docs/push.md)."""

from __future__ import annotations

from mapper.errors import UnsupportedError
from mapper.shared.push import DbTdengine, PushSecrets, PushWriter

#: The reason a Device naming TDengine is told.
NOT_SUPPORTED = (
    "dbMethod TDEngine is not supported: tdengine has no server to test against here (not packaged for Debian), "
    "so gpu-mapper does not write to it; use influxdb2, redis or mysql"
)


def make_writer(method: DbTdengine, secrets: PushSecrets, *, timeout_s: float) -> PushWriter:
    """Always an ``UnsupportedError`` (a ``PermanentError``, reason ``not-supported``) naming the destination."""
    raise UnsupportedError(f"{NOT_SUPPORTED} (addr {method.addr!r}, dbName {method.db_name!r})")
