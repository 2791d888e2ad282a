"""A DB method's ``addr`` (``host:port``, ``[v6]:port``, or a host alone) as a host and a port."""

from __future__ import annotations

from mapper.errors import PermanentError, short_repr


def host_port(addr: str, *, default_port: int, what: str) -> tuple[str, int]:
    """``addr`` split into host and port; ``default_port`` when it names none (as the MySQL driver does; go-redis
    would refuse). A bare IPv6 address (more than one colon, no brackets) is a host alone. ``PermanentError``
    (reason ``bad-addr``) naming ``what`` for anything else."""
    text = addr.strip()
    host, port_text = text, ""
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            host = ""
        port_text = rest[1:]
        if rest == ":":
            host = ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        if not port_text:
            host = ""
    if not host or any(ch.isspace() or ch in "/@?#" for ch in host):
        raise PermanentError(f"{what} addr {short_repr(addr)}: want host:port", reason="bad-addr")
    if not port_text:
        return host, default_port
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise PermanentError(f"{what} addr {short_repr(addr)}: the port is not 1..65535", reason="bad-addr")
    return host, int(port_text)
