"""A real Prometheus for tests (Debian package ``prometheus``): the remote-write receiver on, an out-of-order
window from its config file, a free loopback port, its own data directory; PromQL over its HTTP API."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.brokers import free_port


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise RuntimeError("prometheus is not installed: scripts/bootstrap.sh --test installs it (Debian prometheus)")
    return found


class Prometheus:
    def __init__(self, workdir: Path, *, ooo_window: str = "2h", scrape: dict[str, str] | None = None) -> None:
        """``scrape``: scrape jobs, job name -> target ``host:port``, every second (none by default)."""
        self.workdir = workdir
        self.scrape = scrape or {}
        self.port = free_port()
        self.ooo_window = ooo_window
        self.data = workdir / f"prom-data-{self.port}"
        self.config = workdir / f"prometheus-{self.port}.yml"
        self.log_path = workdir / f"prometheus-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def write_url(self) -> str:
        return self.url + "/api/v1/write"

    def start(self, timeout_s: float = 60.0) -> None:
        jobs = "".join(
            f"  - job_name: {job}\n    scrape_interval: 1s\n    static_configs: [{{targets: ['{target}']}}]\n"
            for job, target in self.scrape.items()
        )
        self.config.write_text(
            f"global:\n  scrape_interval: 1h\nstorage:\n  tsdb:\n    out_of_order_time_window: {self.ooo_window}\n"
            + (f"scrape_configs:\n{jobs}" if jobs else "")
        )
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.data}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-remote-write-receiver",
                "--storage.tsdb.retention.time=30d",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=log,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_path.read_text()[-3000:]}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.url + "/-/ready", timeout=1) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready within {timeout_s}s: {self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; the ``data`` of a success, AssertionError naming the error otherwise."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                doc = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            doc = json.loads(exc.read() or b"{}")
            raise AssertionError(f"{path} {params}: HTTP {exc.code}: {doc.get('error')}") from None
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str, at_s: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at_s is not None:
            params["time"] = f"{at_s:.3f}"
        data = self.api("query", **params)
        result: list[dict[str, Any]] = data["result"] if data["resultType"] in ("vector", "matrix") else []
        return result

    def raw_samples(self, selector: str, at_s: float, window_s: int) -> dict[tuple[tuple[str, str], ...], list]:
        """Every raw sample of the series matching ``selector`` in (at_s - window_s, at_s]: labels -> [(t_ms, v)]."""
        out = {}
        for series in self.query(f"{selector}[{window_s}s]", at_s):
            key = tuple(sorted(series["metric"].items()))
            out[key] = [(round(float(t) * 1000), float(v)) for t, v in series["values"]]
        return out
