"""The DMI side of one mapper, made from its settings: the mapper's own DMI server, the client that registers
with EdgeCore, and the rate-limited reporter over that client. Made, not started: the composition root starts
the server (``DmiServer.start``) and runs the client and the reporter as tasks."""

from __future__ import annotations

from mapper.clock import Clock
from mapper.edge.config import Settings
from mapper.edge.kubeedge.dmi.client import DmiClient, DmiReporter, OnRegistered
from mapper.edge.kubeedge.dmi.server import DmiServer, TwinsOf
from mapper.edge.kubeedge.registry import Registry


def build_dmi(
    settings: Settings,
    version: str,
    registry: Registry,
    twins_of: TwinsOf,
    on_registered: OnRegistered,
    clock: Clock,
    *,
    devices: int,
) -> tuple[DmiServer, DmiClient, DmiReporter]:
    """The server (not listening yet), the client (EdgeCore's registration replies to ``on_registered``) and the
    reporter (``devices``: the node's GPUs, one token each kept for prompt reports: one Device per GPU may
    change at once)."""
    server = DmiServer(
        registry, twins_of, socket_path=settings.socket, max_message_bytes=settings.dmi_max_message_bytes
    )
    client = DmiClient(
        edgecore_socket=settings.edgecore_socket,
        mapper_socket=settings.socket,
        version=version,
        rate_per_s=settings.dmi_rate_per_s,
        burst=settings.dmi_burst,
        clock=clock,
        on_registered=on_registered,
    )
    return server, client, DmiReporter(client, clock=clock, devices=devices)
