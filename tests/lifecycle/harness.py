"""One lifecycle sequence: a world of real processes (``world.py``), a list of steps (``plan.py``), the harness's
model of what must hold, and the invariants checked after every step.

The invariants (each a ``Violation.invariant`` name):

* ``mapper-exited`` / ``bridge-exited``: a process the harness did not stop is gone; ``exit-code``: one the
  harness stopped with SIGTERM did not exit 0 (or a mapper pointed at a file as its data dir did not exit 1,
  the documented fatal cause);
* ``gpu-setting``: a GPU's setting (power limit; a Jetson's devfreq ``max_freq``) is not what the operator's
  valid input asks for: a desired value lost, or a setting changed because of bad input (``bad-input`` in the
  message when the step was a typo);
* ``status`` / ``metrics`` / ``twins``: ``/status`` (the GPU's Device and state, the sampled setting),
  ``/metrics`` and the twins (the test EdgeCore's ``ReportDeviceStatus`` records, or the EventBus twin updates)
  disagree with the GPU longer than the report cycle allows (a bounded wait);
* ``stream-identity``: a telemetry batch published with the (device, boot id, seq) of an earlier one and other
  samples;
* ``delivery``: a sample of a published batch is not in Prometheus once the pipeline had time to write it, or
  Prometheus holds it twice, with another value, or holds one that was never published; at the end, a seq
  missing from a stream beyond the batches the mapper counted as dropped;
* ``foreign-file``: the mapper changed the mode of (or removed) a file it did not create;
* ``healthz``: a running mapper's ``/healthz`` did not answer 200 within the view bound;
* ``dmi``: the mapper refused a valid Device over DMI (or took a refused one);
* ``harness-error``: the harness itself failed (reported with the sequence; the run goes on).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sqlite3
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mapper.shared import naming
from mapper.wire.telemetry import decode_batch
from tests.brokers import free_port
from tests.faults.rig import PersistentBroker
from tests.lifecycle.plan import SeqConfig, Step
from tests.lifecycle.world import (
    BridgeProc,
    EdgeCoreHost,
    MapperProc,
    Sniffer,
    TmpfsDir,
    http_get,
    rmtree,
    short_socket_dir,
    wait,
)
from tests.promserver import Prometheus

#: Plain catalog series: property -> (series name, scale). Every numeric sample of these in a batch is one sample
#: in Prometheus, at its timestamp, value * scale (docs/bridge.md).
#: The properties the bridge writes as families of their own (``mapper/bridge/core.py``) are left out.
_DERIVED = {
    naming.CLOCK_EVENT_REASONS_PROPERTY,
    naming.COMPUTE_MODE_PROPERTY,
    naming.PRODUCT_NAME_PROPERTY,
    naming.POLICY_STATE_PROPERTY,
}
PLAIN = {
    ps.spec.name: (ps.family.series_name, ps.scale) for ps in naming.PROPERTY_SERIES if ps.spec.name not in _DERIVED
}
PLAIN_RE = "|".join(sorted({s for s, _ in PLAIN.values()}))

#: How long a view may lag the GPU: a few report cycles (1 s here) on a loaded 2-core machine.
VIEW_BOUND_S = 8.0
#: How long the bridge may take to write what was published (batch delay 0.2 s, uuid wait 2 s, a restart).
DELIVERY_BOUND_S = 20.0
#: Parts published at least this long ago must already be in Prometheus at a step's check.
DELIVERY_AGE_S = 3.0
#: How soon after a broker restart a missing sample counts as published "just after" it (the message says so).
BROKER_RESTART_WINDOW_S = 5.0
BAD_INPUT_STEPS = ("typo_value", "typo_file")
MAPPER_CONFIG = """telemetry: {window: 1s}
defaults: {reportCycle: 1000, stateReportCycle: 2000}
"""


#: Diagnostics only (never set in CI): invariants whose violations are noted and not raised, to see what else a
#: sequence finds on a branch where one fault shows in every sequence.
IGNORED = frozenset(filter(None, os.environ.get("GPU_MAPPER_LIFECYCLE_IGNORE", "").split(",")))


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit)\b.*)$")


def exit_cause(log: str) -> str:
    """What a process's log says ended it: its 'crashed' line and the last exception's line (or 'no reason logged')."""
    lines = log.splitlines()
    crashed = next((ln.split(" ", 3)[-1] for ln in reversed(lines) if "crashed" in ln or "CRITICAL" in ln), "")
    exc = next((m.group(1) for ln in reversed(lines) if (m := _EXC_LINE.match(ln.strip()))), "")
    return " / ".join(x for x in (crashed, exc) if x) or "no reason logged"


class Violation(Exception):
    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant
        self.message = message
        self.step = -1


@dataclass
class Outcome:
    cfg: SeqConfig
    steps: list[Step]
    violation: Violation | None = None
    executed: int = 0
    skipped: int = 0
    wall_s: float = 0.0
    workdir: str = ""
    notes: list[str] = field(default_factory=list)


# --- the knob: the GPU setting the sequence drives -------------------------------------------------------------


class Knob:
    """The writable property the sequence's Devices desire, how a raw value parses, and the GPU's default."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.prop = "power_limit" if kind == "nvml" else "gpu_max_freq"
        self.group = "power_limit" if kind == "nvml" else "gpu_freq_range"
        self.default = 700.0 if kind == "nvml" else 0.0  # the Jetson's: read from its tree at start
        self.freqs_mhz: list[float] = []

    def parse(self, raw: str | None) -> float | None:
        """The setting a raw desired value asks for; None for a value the mapper must refuse."""
        if raw is None:
            return self.default
        try:
            x = float(raw)
        except ValueError:
            return None
        if not math.isfinite(x) or x < 0:
            return None
        if self.kind == "nvml":
            return x if 200.0 <= x <= 700.0 else None
        below = [f for f in self.freqs_mhz if f <= x + 1e-6]
        return below[-1] if below else None


@dataclass
class Dev:
    gpu: int
    value: str | None


def device_doc(cfg: SeqConfig, node: str, name: str, uuid: Any, value: str | None) -> dict[str, Any]:
    """A Device as ``gpu-mapper discover`` shapes one (fewer properties), with the knob's desired value."""
    knob = "power_limit" if cfg.kind == "nvml" else "gpu_max_freq"
    names = ["temperature", "power_usage", knob, "desired_status", "policy_state"]
    if cfg.kind == "jetson":
        names = ["temperature", "gpu_freq", knob, "desired_status", "policy_state"]
    props: list[dict[str, Any]] = []
    for p in names:
        entry: dict[str, Any] = {"name": p, "collectCycle": 1000, "reportCycle": 1000, "reportToCloud": True}
        if p == knob and value is not None:
            entry["desired"] = {"value": value}
        props.append(entry)
    return {
        "apiVersion": "devices.kubeedge.io/v1beta1",
        "kind": "Device",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "deviceModelRef": {"name": "nvidia-gpu" if cfg.kind == "nvml" else "nvidia-jetson"},
            "nodeName": node,
            "protocol": {"protocolName": "gpu", "configData": {"uuid": uuid}},
            "stateReport": {"reportToCloud": True, "reportCycle": 2000},
            "properties": props,
        },
    }


def broken_yaml(text: str, name: str) -> str:
    """The file with an unclosed quote (an operator's typo): no YAML parser reads it."""
    out = text.replace(f"name: {name}\n", f'name: "{name}\n', 1)
    assert out != text, "the Device's name line is in the file"
    return out


class Run:
    """One sequence in its own world. ``execute()`` runs the steps, checking every invariant after each."""

    def __init__(self, cfg: SeqConfig, steps: list[Step], prom: Prometheus, base: Path, tag: str) -> None:
        self.cfg = cfg
        self.steps = steps
        self.prom = prom
        self.node = f"lc-{cfg.seed}-{tag}"
        self.dir = base / self.node
        self.knob = Knob(cfg.kind)
        self.devices: dict[str, Dev] = {}
        self.broken: set[str] = set()
        self.binding_unknown: set[str] = set()
        self.gpu_unknown: set[int] = set()
        self.expect: dict[int, float] = {}
        self.lost: set[int] = set()
        #: GPUs lost when the running mapper started: NVML does not enumerate them, so that process never shows
        #: them (a reboot brings them back: ``step_gpu_found`` restarts the mapper then).
        self.absent: set[int] = set()
        #: Devices (DMI) the running mapper refused because their GPU is absent from it (``is not on this node``):
        #: EdgeCore keeps them, and the mapper takes them from its registration reply once the GPU is back.
        self.unheld: set[str] = set()
        #: When the broker was started again (monotonic): to say which missing samples were published just after.
        self.broker_started: list[float] = []
        self.uuids: list[str] = []
        self.foreign: Path | None = None
        self.drops_by_process: dict[int, int] = {}
        #: The refused samples each bridge process counted (by process id), the last time it was looked at.
        self.refused_by_bridge: dict[int, int] = {}
        self.mapper: MapperProc | None = None
        self.bridges: list[BridgeProc | None] = []
        self.edge: EdgeCoreHost | None = None
        self.sniffer: Sniffer | None = None
        self.broker: PersistentBroker | None = None
        self.tmpfs: TmpfsDir | None = None
        self.broker_up = False
        self.sock_dir = ""
        self.step_kind = "start"
        self.t0 = time.time()
        self.started_s = time.monotonic()
        self._expected_cache: dict[tuple[Any, ...], list[tuple[tuple[str, str, int], float]]] = {}
        self.mapper_starts = 0
        self.ignored: list[str] = []
        #: The label sets of the series each sample was found in, the last time Prometheus was asked.
        self._prom_labels: dict[tuple[str, str, int], list[dict[str, str]]] = {}

    # ==========================================================================================================
    # the world
    # ==========================================================================================================
    def start(self) -> None:
        rmtree(self.dir)
        self.dir.mkdir(parents=True)
        self.sock_dir = short_socket_dir()
        self.tmpfs = TmpfsDir(self.dir / "data", 16 * 1024)
        self.tmpfs.mount()
        if self.cfg.kind == "jetson":  # the simulated board's tree outside the data dir (it must not fill up)
            (self.dir / "jetson-tree").mkdir()
            (self.dir / "data" / "sim-jetson").symlink_to(self.dir / "jetson-tree")
        (self.dir / "config.yaml").write_text(MAPPER_CONFIG)
        self.broker = PersistentBroker(self.dir)
        self.broker.start()
        self.broker_up = True
        self.sniffer = Sniffer(self.broker.port, self.node, f"{self.node}-sniffer")
        self.bridges = [self._start_bridge(i) for i in range(self.cfg.bridges)]
        if self.cfg.source == "edgecore":
            from mapper.tools.discover import model_doc
            from tests.fake_edgecore import pb_model_from_doc

            self.edge = EdgeCoreHost(f"{self.sock_dir}/dmi.sock")
            model = "nvidia-gpu" if self.cfg.kind == "nvml" else "nvidia-jetson"
            self.edge.edge.models = [pb_model_from_doc(model_doc(name=model))]
        else:
            (self.dir / "devices").mkdir()
            from mapper.tools.discover import model_yaml

            model = "nvidia-gpu" if self.cfg.kind == "nvml" else "nvidia-jetson"
            (self.dir / "devices" / "model.yaml").write_text(model_yaml(name=model))
        self._start_mapper()
        st = self.mapper.status() if self.mapper else None
        gpus = sorted((st or {}).get("gpus", []), key=lambda g: g.get("index", 0))
        self.uuids = [g["uuid"] for g in gpus]
        if len(self.uuids) != self.cfg.gpus:
            raise RuntimeError(f"the mapper lists {len(self.uuids)} GPUs, expected {self.cfg.gpus}")
        if self.cfg.kind == "jetson":
            devfreq = self._devfreq()
            self.knob.freqs_mhz = sorted(int(f) / 1e6 for f in (devfreq / "available_frequencies").read_text().split())
            self.knob.default = int((devfreq / "max_freq").read_text().split()[0]) / 1e6
        self.expect = {g: self.knob.default for g in range(self.cfg.gpus)}
        for w in self.bridges:
            if w is not None and not wait(w.ready, 30):
                raise RuntimeError(f"a bridge is not ready: {w.log_path.read_text()[-2000:]}")

    def _devfreq(self) -> Path:
        root = self.dir / "jetson-tree" / "sys/class/devfreq"
        return next(
            d for d in sorted(root.iterdir()) if (d / "available_frequencies").exists() and (d / "device").exists()
        )

    def _start_bridge(self, i: int) -> BridgeProc:
        assert self.broker is not None
        port = free_port()
        args = ["--mqtt", self.broker.url, "--remote-write", self.prom.write_url]
        args += ["--mqtt-client-id", f"{self.node}-bridge-{i}", "--metrics-addr", f"127.0.0.1:{port}"]
        args += ["--spool-dir", str(self.dir / f"spool-{i}"), "--batch-max-delay", "200ms"]
        args += ["--retry-min-backoff", "100ms", "--retry-max-backoff", "1s", "--uuid-wait", "2s"]
        args += ["--mqtt-reconnect-max-backoff", "1s"]
        return BridgeProc(args, self.dir / f"bridge-{i}.log", port)

    def _mapper_args(self, data_dir: Path, port: int) -> list[str]:
        assert self.broker is not None
        args = ["run", "--sim", str(self.cfg.gpus), "--sim-seed", str(self.cfg.seed % 100_000)]
        if self.cfg.kind == "jetson":
            args += ["--sim-profile", "orin-agx"]
        args += ["--sim-scenario", "steady", "--node-name", self.node, "--data-dir", str(data_dir)]
        args += ["--config", str(self.dir / "config.yaml"), "--mqtt", self.broker.url, "--print-interval", "0"]
        args += ["--socket", f"{self.sock_dir}/gpu.sock", "--metrics-addr", f"127.0.0.1:{port}"]
        if self.cfg.source == "edgecore":
            args += ["--edgecore-socket", f"{self.sock_dir}/dmi.sock"]
        else:
            args += ["--devices", str(self.dir / "devices")]
        return args

    def _start_mapper(self) -> None:
        self.mapper_starts += 1
        self.absent = set(self.lost)
        port = free_port()
        self.mapper = MapperProc(
            self._mapper_args(self.dir / "data", port), self.dir / "gpu-state.json", self.dir / "mapper.log", port
        )
        if not self.mapper.wait_ready(60, gpus=self.cfg.gpus - len(self.absent)):
            code = self.mapper.proc.poll()
            raise Violation("mapper-exited", f"the mapper did not start (exit {code}): {self._log_tail()}")
        if self.cfg.source == "edgecore":
            assert self.edge is not None
            registers = len(self.edge.edge.rec.registers)
            if not wait(lambda: len(self.edge.edge.rec.registers) > registers or self._registered(), 30):  # type: ignore[union-attr]
                raise Violation("mapper-exited", "the mapper did not register with EdgeCore within 30 s")

    def _registered(self) -> bool:
        st = self.mapper.status() if self.mapper else None
        return bool(st and (st.get("dmi") or {}).get("registered"))

    def _log_tail(self, n: int = 3000) -> str:
        return self.mapper.log()[-n:] if self.mapper else ""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.mapper is not None and self.mapper.alive:
                self.mapper.kill()
        for w in self.bridges:
            with contextlib.suppress(Exception):
                if w is not None and w.alive:
                    w.stop("kill")
        with contextlib.suppress(Exception):
            if self.sniffer is not None:
                self.sniffer.close()
        with contextlib.suppress(Exception):
            if self.edge is not None:
                self.edge.close()
        with contextlib.suppress(Exception):
            if self.broker is not None:
                self.broker.stop()
        if self.tmpfs is not None:
            self.tmpfs.close()
        rmtree(self.sock_dir)

    # ==========================================================================================================
    # the Devices' source: a folder or EdgeCore
    # ==========================================================================================================
    def _doc(self, name: str, dev: Dev, *, bad_uuid: bool = False) -> dict[str, Any]:
        uuid: Any = 12345 if bad_uuid else self.uuids[dev.gpu]
        return device_doc(self.cfg, self.node, name, uuid, dev.value)

    def _write_atomic(self, path: Path, text: str) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def _folder_write(self, broken: set[str]) -> bool:
        """Write the folder as the model says (every Device valid except those in ``broken``); False when every
        file already says that (nothing written: the mapper has nothing to read)."""
        folder = self.dir / "devices"
        if self.cfg.one_file:
            path = folder / "devices.yaml"
            if not self.devices:
                if not path.exists():
                    return False
                path.unlink()
                return True
            text = yaml.safe_dump_all([self._doc(n, d) for n, d in sorted(self.devices.items())], sort_keys=False)
            if broken:
                text = broken_yaml(text, sorted(broken)[0])
            if path.exists() and path.read_text() == text:
                return False
            self._write_atomic(path, text)
            return True
        wrote = False
        for path in folder.glob("dev-*.yaml"):
            if path.stem.removeprefix("dev-") not in self.devices:
                path.unlink()
                wrote = True
        for n, d in self.devices.items():
            text = yaml.safe_dump(self._doc(n, d), sort_keys=False)
            if n in broken:
                text = broken_yaml(text, n)
            path = folder / f"dev-{n}.yaml"
            if not path.exists() or path.read_text() != text:
                self._write_atomic(path, text)
                wrote = True
        return wrote

    def _folder_reads(self) -> int:
        return self.mapper.log().count("devices folder: ") if self.mapper else 0

    def _wait_folder_read(self, before: int) -> None:
        """Until the mapper read the folder again (its log says so), or 5 s."""
        wait(lambda: self._folder_reads() > before, 5.0)

    def _dmi(self, method: str, request: Any) -> tuple[bool, str]:
        assert self.edge is not None and self.mapper is not None
        ok, err = self.edge.call(f"{self.sock_dir}/gpu.sock", method, request)
        if not ok and ("UNAVAILABLE" in err or "CANCELLED" in err):
            # The mapper stopping on its own answers so: say that, not the call's failure.
            mapper = self.mapper
            wait(lambda: not mapper.alive, 5.0)
            self.check_alive()
        return ok, err

    def _edge_list(self) -> None:
        """EdgeCore's own list of this node's Devices (what a MapperRegister reply carries), as the model says;
        a Device in ``broken`` is kept in its refused form, as EdgeCore keeps what the cloud sent."""
        from tests.fake_edgecore import pb_from_doc

        assert self.edge is not None
        self.edge.edge.devices = [
            pb_from_doc(self._doc(n, d, bad_uuid=n in self.broken)) for n, d in sorted(self.devices.items())
        ]

    def _pb(self, name: str, *, bad_uuid: bool = False) -> Any:
        from tests.fake_edgecore import pb_from_doc

        return pb_from_doc(self._doc(name, self.devices[name], bad_uuid=bad_uuid))

    def _source_upsert(self, name: str, *, added: bool) -> None:
        """Device ``name`` (valid, as the model holds it) to the mapper."""
        from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb

        self.broken.discard(name)
        if self.cfg.source == "folder":
            before = self._folder_reads()
            if self._folder_write(self.broken):
                self._wait_folder_read(before)
            return
        self._edge_list()
        method = "RegisterDevice" if added else "UpdateDevice"
        request = (pb.RegisterDeviceRequest if added else pb.UpdateDeviceRequest)(device=self._pb(name))
        ok, err = self._dmi(method, request)
        if ok:
            self.unheld.discard(name)
        elif self.devices[name].gpu in self.absent and "is not on this node" in err:
            self.unheld.add(name)  # EdgeCore keeps it; the mapper takes it when the GPU is back (a reboot)
        else:
            raise Violation("dmi", f"{method} {name} (a valid Device) refused: {err}")

    def _source_remove(self, names: list[str]) -> None:
        from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb

        if self.cfg.source == "folder":
            before = self._folder_reads()
            if self._folder_write(self.broken):
                self._wait_folder_read(before)
            return
        self._edge_list()
        for name in names:
            ok, err = self._dmi("RemoveDevice", pb.RemoveDeviceRequest(deviceName=name, deviceNamespace="default"))
            if not ok and name not in self.unheld:
                raise Violation("dmi", f"RemoveDevice {name} refused: {err}")
            self.unheld.discard(name)

    # ==========================================================================================================
    # the model
    # ==========================================================================================================
    def _apply_valid(self, name: str) -> None:
        """Device ``name``'s valid version is in force: its GPU takes the value it asks for (a typo: unchanged)."""
        dev = self.devices[name]
        x = self.knob.parse(dev.value)
        if x is not None:
            self.expect[dev.gpu] = x
        self.broken.discard(name)
        self.binding_unknown.discard(name)
        self.gpu_unknown.discard(dev.gpu)

    def _after_reset(self, gpus: list[int]) -> None:
        """The GPUs' settings went back to their defaults (a driver reload): the mapper applies what is valid."""
        for g in gpus:
            self.expect[g] = self.knob.default
            owner = next((n for n, d in self.devices.items() if d.gpu == g), None)
            if owner is not None:
                if owner in self.binding_unknown:
                    self.gpu_unknown.add(g)
                    continue
                x = self.knob.parse(self.devices[owner].value)
                if x is not None:
                    self.expect[g] = x

    def _one_file_fixed(self) -> None:
        """The one file was written valid: every Device in it is valid again."""
        for n in list(self.broken):
            if n in self.devices:
                self._apply_valid(n)
        self.broken.clear()

    # ==========================================================================================================
    # steps
    # ==========================================================================================================
    def do(self, step: Step) -> bool:
        """Run one step; False when its precondition does not hold (skipped)."""
        fn = getattr(self, f"step_{step.kind}")
        self.step_kind = step.kind
        result: bool = fn(*step.args)
        return result

    def step_add(self, name: str, gpu: int, value: str | None) -> bool:
        if name in self.devices or gpu >= self.cfg.gpus or any(d.gpu == gpu for d in self.devices.values()):
            return False
        self.devices[name] = Dev(gpu, value)
        if self.cfg.one_file:
            self._one_file_fixed()
        self._source_upsert(name, added=True)
        self._apply_valid(name)
        return True

    def step_remove(self, name: str) -> bool:
        if name not in self.devices:
            return False
        dev = self.devices.pop(name)
        self.broken.discard(name)
        self.binding_unknown.discard(name)
        if self.cfg.one_file:
            self._one_file_fixed()
        self._source_remove([name])
        self.expect[dev.gpu] = self.knob.default
        self.gpu_unknown.discard(dev.gpu)
        return True

    def step_readd(self, name: str) -> bool:
        if name not in self.devices:
            return False
        dev = self.devices[name]
        self.step_remove(name)
        uuid = self.uuids[dev.gpu]
        assert self.mapper is not None
        if dev.gpu in self.lost:  # a lost GPU streams nothing to wait for
            return self.step_add(name, dev.gpu, dev.value)
        # Until the mapper streams the GPU unbound again (the telemetry of a GPU no Device names), or 5 s.
        wait(lambda: self._gpu_status(uuid).get("device") == "", 5.0)
        seen = self._parts_of(f"_unbound/{uuid.lower()}")
        wait(lambda: self._parts_of(f"_unbound/{uuid.lower()}") > seen, 3.0)
        return self.step_add(name, dev.gpu, dev.value)

    def _parts_of(self, device: str) -> int:
        assert self.sniffer is not None
        parts, _, _ = self.sniffer.snapshot()
        return sum(1 for k in parts if k[0] == device)

    def step_rename(self, name: str, new: str) -> bool:
        if name not in self.devices or new in self.devices:
            return False
        dev = self.devices.pop(name)
        self.broken.discard(name)
        self.binding_unknown.discard(name)
        self.devices[new] = dev
        if self.cfg.one_file:
            self._one_file_fixed()
        if self.cfg.source == "folder":
            self._source_upsert(new, added=True)  # one write: the old file gone, the new one there
        else:
            self._source_remove([name])
            self._source_upsert(new, added=True)
        self.expect[dev.gpu] = self.knob.default
        self._apply_valid(new)
        return True

    def _set_value(self, name: str, value: str | None) -> bool:
        if name not in self.devices:
            return False
        self.devices[name].value = value
        if self.cfg.one_file:
            self._one_file_fixed()
        self._source_upsert(name, added=False)
        self._apply_valid(name)
        return True

    def step_set(self, name: str, value: str) -> bool:
        return self._set_value(name, value)

    def step_unset(self, name: str) -> bool:
        return self._set_value(name, None)

    def step_typo_value(self, name: str, bad: str) -> bool:
        return self._set_value(name, bad)

    def step_fix_file(self, name: str) -> bool:
        if name not in self.devices or name not in self.broken:
            return False
        if self.cfg.one_file:
            self._one_file_fixed()
        self._source_upsert(name, added=False)
        self._apply_valid(name)
        return True

    def step_typo_file(self, name: str) -> bool:
        """The Device's file with an unclosed quote (the whole file in the one-file layout); over DMI an
        UpdateDevice that fails validation (its uuid a number)."""
        from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb

        if name not in self.devices:
            return False
        hit = set(self.devices) if self.cfg.one_file else {name}
        self.broken |= hit
        if self.cfg.source == "folder":
            before = self._folder_reads()
            if self._folder_write(self.broken):
                self._wait_folder_read(before)
        else:
            self._edge_list()
            ok, _ = self._dmi("UpdateDevice", pb.UpdateDeviceRequest(device=self._pb(name, bad_uuid=True)))
            if ok:
                raise Violation("dmi", f"UpdateDevice {name} with a number as its uuid was accepted")
        self._collect_rounds(2)
        return True

    def step_remove_all(self) -> bool:
        if not self.devices:
            return False
        names = sorted(self.devices)
        for n in names:
            self.expect[self.devices[n].gpu] = self.knob.default
        self.devices.clear()
        self.broken.clear()
        self.binding_unknown.clear()
        self.gpu_unknown.clear()
        self._source_remove(names)
        return True

    def step_broker_stop(self) -> bool:
        assert self.broker is not None
        if not self.broker_up:
            return False
        self.broker.terminate()
        self.broker_up = False
        return True

    def step_broker_start(self) -> bool:
        assert self.broker is not None
        if self.broker_up:
            return False
        self.broker.start()
        self.broker_started.append(time.monotonic())
        self.broker_up = True
        return True

    def _bridge_cycle(self, i: int, how: str) -> bool:
        if i >= len(self.bridges):
            return False
        old = self.bridges[i]
        if old is not None:
            self._scrape_bridge(i)
            code = old.stop(how)
            if how == "term" and code != 0:
                raise Violation("exit-code", f"bridge {i} exited {code} on SIGTERM: {old.log_path.read_text()[-2000:]}")
        w = self._start_bridge(i)
        self.bridges[i] = w
        wait(lambda: w.metrics() is not None or not w.alive, 30)
        return True

    def step_bridge_restart(self, i: int) -> bool:
        return self._bridge_cycle(i, "term")

    def step_bridge_kill(self, i: int) -> bool:
        return self._bridge_cycle(i, "kill")

    def _stop_mapper(self, how: str) -> None:
        assert self.mapper is not None
        self._scrape_mapper()
        if how == "term":
            started = time.monotonic()
            code = self.mapper.terminate()
            took = time.monotonic() - started
            if code != 0:
                raise Violation("exit-code", f"the mapper exited {code} on SIGTERM: {self._log_tail()}")
            if took > 10.0:
                raise Violation("exit-code", f"the mapper took {took:.1f} s to exit on SIGTERM")
        else:
            self.mapper.kill()

    def _restart_mapper(self, how: str) -> None:
        self._stop_mapper(how)
        self._after_mapper_restart()

    def _after_mapper_restart(self) -> None:
        self._start_mapper()
        self.unheld = {n for n, d in self.devices.items() if d.gpu in self.absent}
        # A Device whose source is broken at start was never read by this process: what it is bound to is not
        # said by anything the operator wrote (the GPU keeps its settings: nothing valid asked to change them).
        self.binding_unknown |= self.broken & set(self.devices)

    def step_mapper_term(self) -> bool:
        self._restart_mapper("term")
        return True

    def step_mapper_kill(self) -> bool:
        self._restart_mapper("kill")
        return True

    def step_gpu_lose(self, gpu: int) -> bool:
        if self.cfg.kind != "nvml" or gpu in self.lost:
            return False
        assert self.mapper is not None
        self.mapper.control(op="lose", gpu=gpu)
        self.lost.add(gpu)
        return True

    def step_gpu_found(self) -> bool:
        if self.cfg.kind != "nvml" or not self.lost:
            return False
        assert self.mapper is not None
        self.mapper.control(op="reload", recover=True)
        self.lost.clear()
        self._after_reset(list(range(self.cfg.gpus)))
        # What brings a GPU that fell off the bus back is a reboot: the mapper starts again too. (A running mapper
        # probes a lost GPU every lost_retry_s, mapper/edge/gpu/nvml.py; seed 239 of the long run waited 8 s.)
        self._restart_mapper("term")
        return True

    def step_driver_reload(self) -> bool:
        if self.cfg.kind == "nvml":
            assert self.mapper is not None
            self.mapper.control(op="reload", recover=False)
            self._after_reset([g for g in range(self.cfg.gpus) if g not in self.lost])
            return True
        # A Jetson: the range set behind the mapper's back (another tool), back to the power mode's.
        devfreq = self._devfreq()
        (devfreq / "max_freq").write_text(f"{round(self.knob.default * 1e6)}\n")
        self._after_reset([0])
        return True

    def step_disk_fill(self) -> bool:
        assert self.tmpfs is not None
        if self.tmpfs.full:
            return False
        self.tmpfs.fill()
        return True

    def step_disk_free(self) -> bool:
        assert self.tmpfs is not None
        if not self.tmpfs.full:
            return False
        self.tmpfs.free()
        return True

    def step_wait(self, seconds: float) -> bool:
        time.sleep(seconds)  # the step is time passing; the invariants are checked after it
        return True

    def step_bad_data_dir(self) -> bool:
        """The operator restarts the mapper with ``--data-dir`` mistyped: it names a file (``/etc/hostname``)."""
        target = self.dir / "hostname"
        target.write_text("edge-1\n")
        target.chmod(0o644)
        before = target.stat()
        self._stop_mapper("term")
        port = free_port()
        bad = MapperProc(self._mapper_args(target, port), self.dir / "gpu-state.json", self.dir / "mapper.log", port)
        try:
            code = bad.proc.wait(60)
        finally:
            if bad.alive:
                bad.kill()
        after = target.stat()
        if (after.st_mode, after.st_uid, target.read_text()) != (before.st_mode, before.st_uid, "edge-1\n"):
            raise Violation(
                "foreign-file",
                f"--data-dir pointing at a file changed it: mode {oct(before.st_mode)} -> {oct(after.st_mode)}",
            )
        if code != 1:
            raise Violation(
                "exit-code", f"--data-dir pointing at a file: exit {code}, documented 1: {bad.log()[-2000:]}"
            )
        self._after_mapper_restart()
        return True

    def step_foreign_file(self) -> bool:
        """An operator's file in the data dir (the mapper stopped meanwhile): the mapper must leave it alone."""
        assert self.tmpfs is not None
        if self.foreign is not None or self.tmpfs.full:
            return False
        self._stop_mapper("term")
        self.foreign = self.dir / "data" / "operator-notes.txt"
        self.foreign.write_text("kept by the operator\n")
        self.foreign.chmod(0o644)
        self._after_mapper_restart()
        return True

    # ==========================================================================================================
    # observations
    # ==========================================================================================================
    def _status(self) -> dict[str, Any]:
        return (self.mapper.status() if self.mapper else None) or {}

    def _gpu_status(self, uuid: str) -> dict[str, Any]:
        return next((g for g in self._status().get("gpus", []) if g.get("uuid") == uuid), {})

    def _collect_rounds(self, n: int) -> None:
        """Until the mapper finished ``n`` more collect rounds (or 10 s)."""

        def rounds() -> int:
            counts = ((self._status().get("collect") or {}).get("duration") or {}).get("counts") or []
            return int(sum(counts))

        start = rounds()
        wait(lambda: rounds() >= start + n, 10.0)

    def _sim_values(self) -> dict[int, tuple[float, bool]] | None:
        """GPU index -> (the knob's value on the GPU, lost)."""
        if self.cfg.kind == "jetson":
            try:
                hz = int((self._devfreq() / "max_freq").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return None
            return {0: (hz / 1e6, False)}
        assert self.mapper is not None
        state = self.mapper.control(op="state")
        if not isinstance(state, list):
            return None
        by_uuid = {s["uuid"]: s for s in state}
        return {
            g: (by_uuid[u]["power_limit_mw"] / 1000.0, bool(by_uuid[u]["lost"]))
            for g, u in enumerate(self.uuids)
            if u in by_uuid
        }

    def _scrape_mapper(self) -> None:
        st = self._status()
        drops = (st.get("buffer") or {}).get("drops") or {}
        if st:
            self.drops_by_process[self.mapper_starts] = int(sum(drops.values()))

    def _scrape_bridge(self, i: int) -> None:
        w = self.bridges[i]
        m = w.metrics() if w is not None else None
        if m is None:
            return
        assert w is not None
        refused = sum(v for (n, _), v in m.items() if n == "gpu_mapper_bridge_refused_samples_total")
        self.refused_by_bridge[w.proc.pid] = int(refused)

    # ==========================================================================================================
    # invariants
    # ==========================================================================================================
    def check(self, final: bool = False) -> None:
        for check in (self.check_alive, self.check_gpus, self.check_views, self.check_twins):
            self._checked(check)
        self._checked(self.check_stream_identity)
        self._checked(lambda: self.check_delivery(final))
        self._checked(self.check_foreign)
        self._checked(self.check_health)
        self._checked(self.check_alive)

    def check_health(self) -> None:
        """A running mapper's ``/healthz`` answers 200 within the view bound: it fails only while a loop's heartbeat
        is stale (``mapper/net/http.py``); a full data dir, a lost GPU, a broker away must not fail it (issue 27)."""
        assert self.mapper is not None
        port = self.mapper.port
        last: list[Any] = [None]

        def healthy() -> bool:
            last[0] = http_get(f"http://127.0.0.1:{port}/healthz", 2.0)
            return last[0] is not None and last[0][0] == 200

        if not wait(healthy, VIEW_BOUND_S, 0.2) and self.mapper.alive:
            code, body = last[0] if last[0] is not None else ("nothing", b"")
            raise Violation("healthz", f"/healthz answered {code}: {body[:300]!r}")

    def _checked(self, check: Any) -> None:
        try:
            check()
        except Violation as v:
            if self.mapper is not None and not self.mapper.alive and v.invariant != "mapper-exited":
                self.check_alive()  # the mapper's exit is what the other views saw
            if v.invariant not in IGNORED:
                raise
            self.ignored.append(f"{self.step_kind}: {v}"[:500])

    def check_alive(self) -> None:
        assert self.mapper is not None
        if not self.mapper.alive:
            log = self.mapper.log()
            raise Violation(
                "mapper-exited",
                f"the mapper exited on its own with {self.mapper.proc.returncode} ({exit_cause(log)}); "
                f"its log ends: {log[-3000:]}",
            )
        for i, w in enumerate(self.bridges):
            if w is not None and not w.alive and not w.stopped_by_harness:
                raise Violation(
                    "bridge-exited", f"bridge {i} exited with {w.proc.returncode}: {w.log_path.read_text()[-2000:]}"
                )

    def check_gpus(self) -> None:
        last: dict[int, tuple[float, bool]] = {}

        def agree() -> bool:
            nonlocal last
            sim = self._sim_values()
            if sim is None:
                return False
            last = sim
            for g, (value, lost) in sim.items():
                if lost != (g in self.lost):
                    return False
                if lost or g in self.gpu_unknown:
                    continue
                if abs(value - self.expect[g]) > 0.01:
                    return False
            return True

        if wait(agree, VIEW_BOUND_S, 0.1):
            return
        what = "bad input changed a GPU setting" if self.step_kind in BAD_INPUT_STEPS else "desired value not in force"
        diffs = [
            f"GPU {g} ({self.uuids[g]}, Device {self._owner(g)}): {self.knob.prop} {v:g}, expected {self.expect[g]:g}"
            + (" (lost)" if lost else "")
            for g, (v, lost) in sorted(last.items())
            if not lost and g not in self.gpu_unknown and abs(v - self.expect[g]) > 0.01
        ]
        diffs += [
            f"GPU {g}: lost {lost}, expected {g in self.lost}"
            for g, (_, lost) in last.items()
            if lost != (g in self.lost)
        ]
        raise Violation("gpu-setting", f"{what}: {'; '.join(diffs) or 'the simulator did not answer'}")

    def _owner(self, gpu: int) -> str | None:
        return next((n for n, d in self.devices.items() if d.gpu == gpu), None)

    def check_views(self) -> None:
        """``/status`` and ``/metrics`` agree with the GPU (and with the model's Devices) within the bound."""
        problems: list[str] = []
        series, scale = PLAIN[self.knob.prop]

        def agree() -> bool:
            problems.clear()
            sim = self._sim_values() or {}
            st = self._status()
            if not st:
                problems.append("/status does not answer")
                return False
            metrics = (self.mapper.metrics() if self.mapper else None) or {}
            by_uuid = {g.get("uuid"): g for g in st.get("gpus", [])}
            for g, uuid in enumerate(self.uuids):
                gs = by_uuid.get(uuid)
                if gs is None:
                    if g not in self.absent:
                        problems.append(f"GPU {uuid} missing from /status")
                    continue
                owner = self._owner(g)
                if owner is None or owner not in self.binding_unknown:
                    want = f"default/{owner}" if owner else ""
                    if gs.get("device", "") != want:
                        problems.append(f"/status: GPU {g} is Device {gs.get('device')!r}, expected {want!r}")
                lost = g in self.lost
                if lost != (gs.get("state") == "offline"):
                    problems.append(f"/status: GPU {g} state {gs.get('state')!r}, lost {lost}")
                if lost or owner is None or owner in self.binding_unknown or g not in sim:
                    continue
                value = ((gs.get("sample") or {}).get("values") or {}).get(self.knob.prop)
                if not isinstance(value, int | float) or abs(float(value) - sim[g][0]) > 0.01:
                    problems.append(f"/status: GPU {g} {self.knob.prop} {value}, the GPU {sim[g][0]:g}")
                got = [v for (n, labels), v in metrics.items() if n == series and ("uuid", uuid) in labels]
                if not got or abs(got[0] - sim[g][0] * scale) > 0.01 * max(1.0, scale):
                    problems.append(f"/metrics: {series} of GPU {g} {got}, the GPU {sim[g][0] * scale:g}")
            return not problems

        if not wait(agree, VIEW_BOUND_S, 0.1):
            invariant = "metrics" if all(p.startswith("/metrics") for p in problems) else "status"
            raise Violation(invariant, "; ".join(problems))

    def check_twins(self) -> None:
        """The twins (EdgeCore's record, or the EventBus updates) agree with the GPU within the bound."""
        if self.cfg.source == "folder" and not self.broker_up:
            return
        problems: list[str] = []

        def agree() -> bool:
            problems.clear()
            sim = self._sim_values() or {}
            if self.edge is not None:
                latest = {n: {p: v[0] for p, v in t.items()} for n, t in self.edge.latest_twins().items()}
            else:
                assert self.sniffer is not None
                latest = {n: {p: v[0] for p, v in t.items()} for n, t in self.sniffer.twins().items()}
            for name, dev in self.devices.items():
                if name in self.binding_unknown or dev.gpu in self.lost or dev.gpu not in sim:
                    continue
                twins = latest.get(name, {})
                reported = twins.get(self.knob.prop)
                try:
                    ok = reported is not None and abs(float(reported) - sim[dev.gpu][0]) <= 0.6
                except ValueError:
                    ok = False
                if not ok:
                    problems.append(f"twin {name}/{self.knob.prop} {reported!r}, the GPU {sim[dev.gpu][0]:g}")
                status = twins.get("desired_status", "")
                groups = dict(part.split(":", 1) for part in status.split(",") if ":" in part)
                x = self.knob.parse(dev.value)
                if dev.value is None:
                    want_ok = self.knob.group not in groups
                elif x is None:
                    want_ok = groups.get(self.knob.group, "").startswith("rejected-")
                else:
                    want_ok = groups.get(self.knob.group, "").startswith("applied")
                if not want_ok:
                    problems.append(f"twin {name}/desired_status {status!r} for desired {dev.value!r}")
            return not problems

        if not wait(agree, VIEW_BOUND_S + 4.0, 0.2):
            raise Violation("twins", "; ".join(problems))

    # --- delivery ------------------------------------------------------------------------------------------------
    def _expected(self, key: tuple[Any, ...], part: Any) -> list[tuple[tuple[str, str, int], float]]:
        got = self._expected_cache.get(key)
        if got is None:
            label = naming.device_label(part.device)
            got = []
            for ts, values in part.samples:
                for prop, v in values:
                    entry = PLAIN.get(prop)
                    if entry is None:
                        continue
                    series, scale = entry
                    if isinstance(v, bool):
                        x = scale if v else 0.0
                    elif isinstance(v, int | float):
                        if isinstance(v, float) and not math.isfinite(v):
                            continue
                        x = v * scale
                    else:
                        continue
                    got.append(((series, label, ts), float(x)))
            self._expected_cache[key] = got
        return got

    def _prom(self) -> dict[tuple[str, str, int], list[float]]:
        window = int(time.time() - self.t0) + 120
        out: dict[tuple[str, str, int], list[float]] = {}
        labels: dict[tuple[str, str, int], list[dict[str, str]]] = {}
        for s in self.prom.query(f'{{node="{self.node}",__name__=~"{PLAIN_RE}"}}[{window}s]', time.time() + 1):
            name, device = s["metric"]["__name__"], s["metric"].get("device", "")
            for t, v in s["values"]:
                key = (name, device, round(float(t) * 1000))
                out.setdefault(key, []).append(float(v))
                labels.setdefault(key, []).append(s["metric"])
        self._prom_labels = labels
        return out

    def _label_diff(self, key: tuple[str, str, int]) -> str:
        """How the series that hold one sample more than once differ (their labels that are not the same)."""
        sets = self._prom_labels.get(key, [])
        names = sorted({k for m in sets for k in m})
        differ = [k for k in names if len({m.get(k) for m in sets}) > 1]
        return "; ".join(f"{k}: {[m.get(k) for m in sets]}" for k in differ) or "no label differs"

    def _pipeline_up(self) -> bool:
        return self.broker_up and any(w is not None and w.alive for w in self.bridges)

    def check_stream_identity(self) -> None:
        assert self.sniffer is not None
        _, conflicts, _ = self.sniffer.snapshot()
        if conflicts:
            (device, boot, seq), old, new = conflicts[0]
            raise Violation(
                "stream-identity",
                f"batch {device} boot {boot} seq {seq} published again with other samples "
                f"(its first sample at {old.samples[0][0] if old.samples else '-'} ms, "
                f"now at {new.samples[0][0] if new.samples else '-'} ms)"
                f"; {len(conflicts)} such batch(es)",
            )

    def _published(self) -> list[tuple[tuple[Any, ...], Any]]:
        """Every batch published, each version of a (device, boot id, seq) published with other samples too."""
        assert self.sniffer is not None
        parts, conflicts, _ = self.sniffer.snapshot()
        out: list[tuple[tuple[Any, ...], Any]] = list(parts.items())
        out += [((*key, "again", i), new) for i, (key, _, new) in enumerate(conflicts)]
        return out

    def check_delivery(self, final: bool) -> None:
        if not self._pipeline_up():
            return
        now = time.monotonic()
        want: dict[tuple[str, str, int], float] = {}
        arrived: dict[tuple[str, str, int], float] = {}
        for key, part in self._published():
            if final or now - part.arrived_s >= DELIVERY_AGE_S:
                for k, x in self._expected(key, part):
                    want[k] = x
                    arrived[k] = part.arrived_s
        missing: list[tuple[str, str, int]] = []
        prom: dict[tuple[str, str, int], list[float]] = {}

        def delivered() -> bool:
            nonlocal prom
            prom = self._prom()
            missing[:] = [k for k in want if k not in prom]
            return not missing

        if not wait(delivered, DELIVERY_BOUND_S, 0.25):
            for i in range(len(self.bridges)):
                self._scrape_bridge(i)
            refused = sum(self.refused_by_bridge.values())
            if len(missing) > refused:
                by_device: dict[str, int] = {}
                for _, dev, _ in missing:
                    by_device[dev] = by_device.get(dev, 0) + 1
                dup = sum(
                    v
                    for w in self.bridges
                    if w is not None
                    for (n, _), v in (w.metrics() or {}).items()
                    if n == "gpu_mapper_bridge_duplicate_batches_total"
                )
                # A known cause, named so that a run's violations can be told apart: mosquitto (2.0.11) does not
                # restore shared subscriptions from its persistence file, so what the mapper publishes after a
                # broker restart and before the bridges subscribe again is accepted and goes to no one.
                window = BROKER_RESTART_WINDOW_S
                after_restart = sum(
                    1 for k in missing if any(0.0 <= arrived[k] - t <= window for t in self.broker_started)
                )
                raise Violation(
                    "delivery",
                    f"{len(missing)} of {len(want)} published samples not in Prometheus after {DELIVERY_BOUND_S:g} s "
                    f"({after_restart} of them published within {BROKER_RESTART_WINDOW_S:g} s after a broker restart) "
                    f"(by device: {by_device}; first {sorted(missing)[:3]}); the bridges counted {refused} refused "
                    f"samples and {dup:g} duplicate batches",
                )
        if os.environ.get("GPU_MAPPER_LIFECYCLE_VERBOSE") == "1":
            seqs: dict[str, list[int]] = {}
            for key, _part in self._published():
                seqs.setdefault(key[0][-6:], []).append(key[2])
            print(f"  [{self.node}] delivery: {len(want)} published samples checked, {len(prom)} in Prometheus; {seqs}")
        twice = {k: v for k, v in prom.items() if len(v) > 1}
        if twice:
            k = sorted(twice)[0]
            raise Violation(
                "delivery",
                f"{len(twice)} samples twice in Prometheus, e.g. {k}: {twice[k]}, in series that differ in "
                f"{self._label_diff(k)}",
            )
        wrong = [
            (k, want[k], prom[k][0])
            for k in want
            if k in prom and not math.isclose(want[k], prom[k][0], rel_tol=1e-9, abs_tol=1e-9)
        ]
        if wrong:
            first = wrong[0][0]
            versions = [
                (key[:3], x) for key, part in self._published() for k, x in self._expected(key, part) if k == first
            ]
            # Two versions published under one (device, boot id, seq) is the stream's identity going backwards (the
            # consumer keeps the first); the sniffer may have seen the second after the identity check ran.
            twice = len({x for _, x in versions}) > 1 and len({v for v, _ in versions}) == 1
            if twice:
                assert self.sniffer is not None
                _, conflicts, _ = self.sniffer.snapshot()
                shown = [
                    (
                        [(ts, dict(vals).get(first[0].removeprefix("gpu_"), "-")) for ts, vals in old.samples][:6],
                        [(ts, dict(vals).get(first[0].removeprefix("gpu_"), "-")) for ts, vals in new.samples][:6],
                        old.arrived_s - self.started_s,
                        new.arrived_s - self.started_s,
                    )
                    for key, old, new in conflicts
                    if key == versions[0][0]
                ]
                versions = [*versions, ("the two versions' (sample ts, values) and arrival s", shown)]  # type: ignore[list-item]
            raise Violation(
                "stream-identity" if twice else "delivery",
                f"{len(wrong)} samples with another value in Prometheus, e.g. {wrong[0]}; published as "
                f"(device, boot id, seq) -> value: {versions[:4]}",
            )
        known = {k for key, part in self._published() for k, _ in self._expected(key, part)}
        unknown = [k for k in prom if k not in known]
        if unknown:
            if os.environ.get("GPU_MAPPER_LIFECYCLE_VERBOSE") == "1":
                print(f"  [{self.node}] {len(unknown)} in Prometheus, not yet seen published: {sorted(unknown)[:2]}")
            # Published but not yet seen by the sniffer when it was looked at: look again.
            time.sleep(1.0)
            known = {k for key, part in self._published() for k, _ in self._expected(key, part)}
            unknown = [k for k in unknown if k not in known]
            if unknown:
                raise Violation(
                    "delivery", f"{len(unknown)} samples in Prometheus never published, e.g. {sorted(unknown)[:3]}"
                )

    def check_foreign(self) -> None:
        if self.foreign is None:
            return
        try:
            mode = self.foreign.stat().st_mode & 0o7777
        except FileNotFoundError:
            raise Violation(
                "foreign-file", f"{self.foreign.name}, the operator's file in the data dir, is gone"
            ) from None
        if mode != 0o644:
            raise Violation(
                "foreign-file", f"{self.foreign.name}, the operator's 0644 file in the data dir, is now {oct(mode)}"
            )

    # ==========================================================================================================
    # the end of a sequence
    # ==========================================================================================================
    def finish(self) -> None:
        """Heal the world (disk freed, broker and bridges up, lost GPUs back), wait for the backlog to go out, check
        everything once more, stop the mapper (exit 0) and account for every seq of every stream."""
        assert self.mapper is not None and self.tmpfs is not None and self.sniffer is not None
        self.step_kind = "final"
        if self.tmpfs.full:
            self.tmpfs.free()
        if not self.broker_up:
            self.step_broker_start()
        for i, w in enumerate(self.bridges):
            if w is None or not w.alive:
                self._bridge_cycle(i, "kill")
        if self.lost:
            self.step_gpu_found()
        self.check_alive()
        if not wait(lambda: (self._status().get("buffer") or {}).get("batches", 1) == 0, 45.0, 0.2):
            raise Violation("delivery", f"the backlog was not sent within 45 s: {self._status().get('buffer')}")
        self.check(final=True)
        self._stop_mapper("term")
        for i, w in enumerate(self.bridges):
            if w is not None:
                self._scrape_bridge(i)
                code = w.stop("term")
                if code != 0:
                    raise Violation(
                        "exit-code", f"bridge {i} exited {code} on SIGTERM: {w.log_path.read_text()[-2000:]}"
                    )
        self.account_seqs()

    def account_seqs(self) -> None:
        """Every seq between the first and the last one of each stream was published or is still buffered,
        except as many as the mapper counted as dropped."""
        assert self.sniffer is not None
        parts, _, _ = self.sniffer.snapshot()
        seen: dict[tuple[str, str], set[int]] = {}
        for device, boot, seq in parts:
            seen.setdefault((device, boot), set()).add(seq)
        for device, boot, seq in self._buffered():
            seen.setdefault((device, boot), set()).add(seq)
        missing = 0
        examples: list[str] = []
        for (device, boot), seqs in sorted(seen.items()):
            gap = sorted(set(range(min(seqs), max(seqs) + 1)) - seqs)
            missing += len(gap)
            if gap:
                examples.append(f"{device} boot {boot}: {gap[:5]}")
        drops = sum(self.drops_by_process.values())
        if missing > drops:
            raise Violation(
                "delivery",
                f"{missing} stored batches never published (the mapper counted {drops} dropped): {examples[:3]}",
            )

    def _buffered(self) -> list[tuple[str, str, int]]:
        path = self.dir / "data" / "telemetry.db"
        out: list[tuple[str, str, int]] = []
        if not path.exists():
            return out
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            for (payload,) in db.execute("SELECT payload FROM batches"):
                try:
                    batch = decode_batch(payload)
                except Exception:
                    continue
                for part in batch.split() if batch.merged else (batch,):
                    out.append((part.device, part.boot_id, part.seq))
        return out

    # ==========================================================================================================
    def execute(self) -> Outcome:
        out = Outcome(self.cfg, self.steps, workdir=str(self.dir))
        started = time.monotonic()
        index = -1
        try:
            self.start()
            self.check()
            verbose = os.environ.get("GPU_MAPPER_LIFECYCLE_VERBOSE") == "1"
            for index, step in enumerate(self.steps):
                t = time.monotonic()
                if self.do(step):
                    out.executed += 1
                    t2 = time.monotonic()
                    self.check()
                    if verbose:
                        print(
                            f"  [{self.node}] {index} {step}: {t2 - t:.2f} s + checks {time.monotonic() - t2:.2f} s",
                            flush=True,
                        )
                else:
                    out.skipped += 1
            index = len(self.steps)
            self.finish()
        except Violation as v:
            v.step = index
            out.violation = v
        except Exception as exc:  # the harness's own failure: reported with the sequence, the run goes on
            v = Violation("harness-error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}")
            v.step = index
            out.violation = v
        finally:
            self.close()
            out.wall_s = time.monotonic() - started
            out.notes = self.ignored
        return out
