"""DMI twin report cost: one ``ReportDeviceStatus`` carrying every catalog property of one GPU, sent through
``DmiClient.report_status`` (twin validation, pb building, one RPC over a real Unix socket to the test EdgeCore
in this process), against a baseline of the bare generated stub sending a request built beforehand on the same
kind of channel: what the mapper's client adds per report.

Also: the whole reporter path (``DmiReporter.offer_status`` for 8 GPUs every second, ``send_ready``) over one
simulated hour on a fake clock, with the test EdgeCore enforcing its real limit on the same clock: RPCs sent per
second, refusals, and offers per RPC (coalescing).

Run: ``.venv/bin/python benchmarks/dmi_report.py [--quick]``. Prints one JSON line last; ``ratio`` is client
latency / bare-stub latency (median).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc.aio

from mapper.clock import FakeClock
from mapper.edge.kubeedge.dmi import convert
from mapper.edge.kubeedge.dmi.client import DmiClient, DmiReporter
from mapper.edge.kubeedge.dmi.pb import dmi_pb2_grpc as pb_grpc
from mapper.shared.model import PROPERTIES, Twin
from tests.fake_edgecore import FakeEdgeCore


def catalog_twins(i: int) -> list[Twin]:
    return [Twin(p.name, "300" if p.writable else "", str(i % 97)) for p in PROPERTIES]


async def latency(sock_dir: str, n: int) -> dict[str, float]:
    edge = FakeEdgeCore(os.path.join(sock_dir, "dmi.sock"), enforce_rate=False)
    await edge.start()
    client = DmiClient(edgecore_socket=edge.socket_path, mapper_socket=os.path.join(sock_dir, "gpu.sock"))
    request = convert.status_request("default", "gpu0", catalog_twins(0))
    try:
        async with grpc.aio.insecure_channel(f"unix://{edge.socket_path}") as channel:
            stub = pb_grpc.DeviceManagerServiceStub(channel)
            bare: list[float] = []
            ours: list[float] = []
            for i in range(n + 50):  # interleaved, first 50 of each are warm-up
                t0 = time.perf_counter()
                await stub.ReportDeviceStatus(request, timeout=5)
                t1 = time.perf_counter()
                await client.report_status("default", "gpu0", catalog_twins(i))
                t2 = time.perf_counter()
                if i >= 50:
                    bare.append(t1 - t0)
                    ours.append(t2 - t1)
    finally:
        await client.close()
        await edge.stop()
    return {
        "twins_per_report": len(PROPERTIES),
        "bare_p50_us": statistics.median(bare) * 1e6,
        "client_p50_us": statistics.median(ours) * 1e6,
        "client_p99_us": sorted(ours)[int(len(ours) * 0.99) - 1] * 1e6,
        "ratio": statistics.median(ours) / statistics.median(bare),
    }


async def hour_of_reports(sock_dir: str, seconds: int) -> dict[str, float]:
    clock = FakeClock()
    edge = FakeEdgeCore(os.path.join(sock_dir, "dmi2.sock"), now=clock.monotonic)
    await edge.start()
    client = DmiClient(edgecore_socket=edge.socket_path, mapper_socket=os.path.join(sock_dir, "gpu.sock"), clock=clock)
    reporter = DmiReporter(client)
    offers = 0
    try:
        await client.step()
        for second in range(seconds):
            for d in range(8):
                reporter.offer_status("default", f"gpu{d}", catalog_twins(second))
                offers += 1
                if second % 30 == d:
                    reporter.offer_state("default", f"gpu{d}", "online")
                    offers += 1
            for _ in range(10):
                await reporter.send_ready()
                clock.advance(0.1)
    finally:
        await client.close()
        await edge.stop()
    rpcs = len(edge.rec.call_times)
    return {
        "window_s": seconds,
        "offers": offers,
        "rpcs": rpcs,
        "rpcs_per_s": rpcs / seconds,
        "edgecore_refusals": len(edge.rec.refused),
        "offers_per_rpc": offers / rpcs,
        "twin_reports_per_gpu_per_min": reporter.sent["status"] / 8 / (seconds / 60),
    }


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sock_dir = tempfile.mkdtemp(prefix="dmib-", dir="/tmp")
    try:
        lat = await latency(sock_dir, 200 if args.quick else 2000)
        hour = await hour_of_reports(sock_dir, 300 if args.quick else 3600)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    print(json.dumps({"benchmark": "dmi_report", **{k: round(v, 3) for k, v in {**lat, **hour}.items()}}))


if __name__ == "__main__":
    asyncio.run(main())
