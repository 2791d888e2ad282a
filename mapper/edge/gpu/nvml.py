"""NvmlBackend: the GpuBackend over NVML, and the only module that calls NVML.

It is given the nvml module: the real ``pynvml`` (from ``nvidia-ml-py``) in production, a
``mapper.edge.gpu.simnvml.SimNvml`` instance in tests and demos. Nothing here asks which one it has.

* GPUs by UUID; handles cached by UUID for the current NVML session (the index is only a label).
* ``sample()`` reads every catalog property in catalog units with one NVML call per value
  (``nvmlDeviceGetFieldValues`` for energy and for memory temperature, a call each: a field batch costs what its
  dearest field costs). The dear reads are kept apart (docs/architecture.md, "Dear reads"): the energy counter
  is read every ``energy_read_s`` (60 s) and derived from power in between (``_EnergyTrack``); PCIe throughput,
  whose call blocks ~20 ms, is read on a thread of its own ahead of its ask. A value NVML reports as NotSupported or
  FunctionNotFound is absent from the sample, remembered per (GPU, call) and asked again only every
  ``unsupported_retry_s`` (a field id, which depends on the driver branch, also at a new NVML session). Which
  readers a set of wanted names needs is worked out once per set (and the set once per list of names a caller
  passes); a plain getter's function and constants are looked up once.
* NVML errors are translated once, in ``_translate``, into ``mapper.errors`` types whose messages name the GPU,
  the call and the value.
* Lazy init; re-init with capped exponential backoff after Unknown, Uninitialized, GpuIsLost, a timeout or a
  detected driver reload. Every public call runs on one worker thread and is bounded by ``call_timeout_s``;
  a call that hangs makes later calls fail fast (TransientError) until it returns, then NVML is re-initialised.
  ``await backend.call_async(backend.sample, uuid)`` runs a public method's NVML work on that same worker and
  wakes the event loop when it is done: no default-executor thread in between, same errors and timeouts; calls
  made in the same loop iteration (the GPU loops of one collect cycle) run as one worker job.
* A GPU lost in the middle of a sample: ``sample()`` raises ``GpuLostError`` (nothing partial is returned), the
  GPU is marked lost, a ``gpu_lost`` event is queued for ``poll_events()``, and later calls for that GPU raise
  ``GpuLostError`` at once without touching NVML, probing again every ``lost_retry_s``.
* Locked clocks have no NVML getter: the backend reports what it set itself since the current NVML init
  (0/0 = not locked); a re-init or a detected driver reload resets that memory to 0 so a reconciler sees drift.
* A driver reload is detected from Uninitialized errors on a live session and from an energy counter that went
  backwards, and reported as ``driver_reload`` events (one per GPU) from ``poll_events()``.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from functools import partial
from types import MappingProxyType
from typing import Any, Generic, Literal, NamedTuple, TypeVar, overload

from mapper.clock import Clock, SystemClock
from mapper.edge.health.checks import CheckResult
from mapper.errors import (
    GpuLostError,
    InvalidValueError,
    MapperError,
    NoPermissionError,
    NotFoundError,
    PermanentError,
    ReadBackMismatchError,
    TransientError,
    UnsupportedError,
)
from mapper.shared.model import (
    COMPUTE_MODE_NAMES,
    COMPUTE_MODES,
    NVML_PROPERTIES,
    PROPERTY_BY_NAME,
    Constraints,
    GpuEvent,
    GpuInfo,
    GpuProcess,
    ProcessSample,
    Sample,
    Value,
    check_number,
    clock_event_reasons_text,
)

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Public methods ``call_async`` refuses: ``shutdown`` does more than one worker job (it stops the worker).
_NOT_ASYNC = frozenset({"shutdown"})

LIBRARY_NAME = "libnvidia-ml.so.1"

ARCHITECTURES: Mapping[int, str] = MappingProxyType(
    {
        2: "kepler",
        3: "maxwell",
        4: "pascal",
        5: "volta",
        6: "turing",
        7: "ampere",
        8: "ada",
        9: "hopper",
        10: "blackwell",
    }
)

# NVML return codes (pynvml.NVML_ERROR_*; stable across binding versions).
_UNINITIALIZED = 1
_INVALID_ARGUMENT = 2
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
_DRIVER_NOT_LOADED = 9
_TIMEOUT = 10
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_CORRUPTED_INFOROM = 14
_GPU_IS_LOST = 15
_LIB_RM_VERSION_MISMATCH = 18
_FREQ_NOT_SUPPORTED = 24
_ARGUMENT_VERSION_MISMATCH = 25
_DEPRECATED = 26
_GPU_NOT_FOUND = 28
_UNKNOWN = 999

#: nvmlInforomObject_t (pynvml.NVML_INFOROM_*).
_INFOROM_OEM = 0
_INFOROM_ECC = 1
_INFOROM_POWER = 2

#: What ``nvmlDeviceGetMemoryInfo(h, version=nvmlMemory_v2)`` answers where there is no v2: read v1 instead.
_MEMORY_V2_ABSENT = frozenset({_FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH, _NOT_SUPPORTED})

#: What to do when nvmlInit fails, by NVML error code (one sentence each; LibraryNotFound has its own message).
_INIT_ADVICE: Mapping[int, str] = MappingProxyType(
    {
        _NO_PERMISSION: "This process cannot open the GPU device files (/dev/nvidiactl, /dev/nvidia0 ...): run it "
        "as a user allowed to open them, or give its container those devices (NVIDIA container toolkit).",
        _DRIVER_NOT_LOADED: "The NVIDIA kernel driver is not loaded: load it (modprobe nvidia) and check that "
        "nvidia-smi answers.",
        _LIB_RM_VERSION_MISMATCH: "The NVML library and the loaded kernel driver are different versions (a driver "
        "upgrade without reload): reload the nvidia kernel modules or reboot the node.",
        _GPU_NOT_FOUND: "NVML sees no NVIDIA GPU: check nvidia-smi, and in a container that the GPUs are passed in "
        "(NVIDIA_VISIBLE_DEVICES).",
        _UNKNOWN: "Check that nvidia-smi answers and the kernel log (dmesg) for NVIDIA errors (Xid); in a container, "
        "restarting it often clears this.",
    }
)
_INIT_ADVICE_OTHER = "Check that nvidia-smi answers and the kernel log (dmesg) for NVIDIA errors (Xid)."

#: Errors after which the NVML session is not trusted any more: re-initialise before the next call.
_SESSION_ERRORS = frozenset({_UNINITIALIZED, _DRIVER_NOT_LOADED, _LIB_RM_VERSION_MISMATCH, _UNKNOWN})

# Field ids (pynvml constants). Each is read in a call of its own: a ``nvmlDeviceGetFieldValues`` call costs what
# its dearest field costs (~4 ms of CPU with energy in it on an H200, 5 us for memory temperature alone).
_FI_MEMORY_TEMP = 82
_FI_ENERGY = 191
#: Per-field statuses that mean "this driver or GPU has no such field": NotSupported, and InvalidArgument from a
#: driver whose field table ends before the id (field 191, energy, is r535+).
_FIELD_ABSENT = frozenset({_NOT_SUPPORTED, _FUNCTION_NOT_FOUND, _DEPRECATED, _INVALID_ARGUMENT})
#: The NotSupported-memory keys of the energy counter's two sources: field 191 (r535+), else
#: ``nvmlDeviceGetTotalEnergyConsumption``.
_ENERGY_FIELD_KEY = f"field:{_FI_ENERGY}"
_ENERGY_CALL_KEY = "call:nvmlDeviceGetTotalEnergyConsumption"
#: NotSupported-memory keys kept for one NVML session only: which field ids answer depends on the driver branch
#: (field 191 is r535+), and a reload may bring another driver. (The group names are those of ``_GROUPS``.)
_SESSION_KEYS = ("temperature_memory", "energy", _ENERGY_FIELD_KEY, _ENERGY_CALL_KEY)
#: How often the energy counter is read by default (``PropertySpec.read_cycle_ms`` of ``energy_consumption``).
ENERGY_READ_S = PROPERTY_BY_NAME["energy_consumption"].read_cycle_ms / 1000.0
#: A read of the energy counter falls due this much before its time, so a sample on the grid a hair early (the
#: collector's slack) takes it rather than the one a cycle later.
_ENERGY_READ_SLACK_S = 0.5
#: Reading groups whose NVML call blocks the calling thread: ``nvmlDeviceGetPcieThroughput`` samples the link for
#: ~20 ms (20.9 ms wall, 0.79 ms CPU per call on an H200). They are read on a thread of their own
#: (``nvml-blocking``: ``NvmlBackend._serve_blocking``), never in the job that samples every GPU, so that one GPU's
#: wait delays no other's sample. (A read that hangs there leaves the PCIe values absent; the samples go on.)
_BLOCKING_GROUPS = frozenset({"pcie_tx", "pcie_rx"})
#: A blocking read is started this long before its group is expected to be asked for again (the GPU's 1 s
#: samples start it), so the value it delivers is about a second old; 16 reads of 21 ms fit in it.
_BLOCKING_LEAD_S = 1.5
#: The first ask of a blocking group (per GPU and NVML session) waits this long at most for its read, so that
#: the first samples after start-up have the value.
_BLOCKING_FIRST_WAIT_S = 1.0
#: A blocking read's value is handed out while its read started at most this long ago.
_BLOCKING_FRESH_S = _BLOCKING_LEAD_S + 1.0
#: The process lists by kind, newest first: v3 (r510+), else v2.
_PROCESS_LIST_CALLS: Mapping[str, tuple[str, ...]] = {
    "compute": ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
    "graphics": ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
}

# Event types (pynvml.nvmlEventType*).
_EV_SBE = 0x1
_EV_DBE = 0x2
_EV_XID = 0x8
_EV_WANTED = _EV_SBE | _EV_DBE | _EV_XID

#: A reload is assumed when the energy counter drops by more than this (joules); a counter never decreases.
_ENERGY_BACKWARDS_J = 1.0
#: How many wanted-property sets (and reading plans) a backend remembers; callers use a handful.
_MEMO_SIZE = 256
#: Accepted difference between a power limit set and the one read back (some boards round to the watt).
_READ_BACK_TOLERANCE_MW = 500


class _FunctionMissing(UnsupportedError):
    """The binding or the driver lacks the function (FunctionNotFound / no such attribute)."""


class SampleRound(NamedTuple):
    """What ``NvmlBackend.sample_many`` read in one job."""

    #: Per request, in order: the GPU's Sample, or the error reading it raised.
    samples: list[Sample | MapperError]
    #: ``poll_events``'s events (empty when not asked for, or when the poll failed).
    events: list[GpuEvent]
    #: The poll's error, when it failed.
    events_error: MapperError | None = None
    #: Per request, in order: when (the backend clock's monotonic seconds) its GPU's read began; the collector
    #: measures each sample's lateness against its due time with it.
    started_s: tuple[float, ...] = ()


class NvmlBackend:
    """The ``mapper.shared.model.GpuBackend`` over an nvml module (``pynvml`` or ``SimNvml``).

    ``one_shot``: for a command that exits after its calls (``discover``): an NVML that cannot start is a
    PermanentError saying what to do, with no retry wording.

    ``energy_read_s``: how often a GPU's energy counter is read (its catalog read cycle, 60 s, by default; 0: at
    every sample, the driver's counter each time); in between ``energy_consumption`` is derived from the power
    readings (``_EnergyTrack``).

    ``blocking_thread``: read the calls that block the calling thread (``_BLOCKING_GROUPS``: PCIe throughput) on
    a thread of their own, ahead of their ask (the default); False reads them where they are asked for, in the
    job that samples every GPU (what a test of the values themselves wants: the value of this moment).

    ``clock`` times backoffs, the NotSupported cache and sample timestamps. ``call_timeout_s`` bounds every
    public call; ``init_timeout_s`` bounds a call that has to (re-)initialise NVML first (the first call after a
    driver load can take seconds). Re-init backoff starts at ``reinit_backoff_s`` and doubles up to
    ``reinit_backoff_max_s``.
    """

    def __init__(
        self,
        nvml: Any,
        *,
        clock: Clock | None = None,
        call_timeout_s: float = 5.0,
        init_timeout_s: float = 30.0,
        unsupported_retry_s: float = 600.0,
        energy_read_s: float | None = None,
        blocking_thread: bool = True,
        reinit_backoff_s: float = 1.0,
        reinit_backoff_max_s: float = 60.0,
        lost_retry_s: float = 60.0,
        init_flags: int = 0,
        one_shot: bool = False,
    ) -> None:
        if call_timeout_s <= 0 or init_timeout_s <= 0:
            raise ValueError("call_timeout_s and init_timeout_s must be > 0")
        self._nvml = nvml
        self._nvml_error: type[Exception] = nvml.NVMLError
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._call_timeout_s = call_timeout_s
        self._init_timeout_s = init_timeout_s
        self._unsupported_retry_s = unsupported_retry_s
        self._blocking_thread = blocking_thread
        self._energy_read_s = ENERGY_READ_S if energy_read_s is None else energy_read_s
        if self._energy_read_s < 0:
            raise ValueError(f"energy_read_s must be >= 0, got {energy_read_s}")
        self._backoff_s = reinit_backoff_s
        self._backoff_max_s = reinit_backoff_max_s
        self._lost_retry_s = lost_retry_s
        self._init_flags = init_flags
        #: A command that makes its calls and exits (``discover``): errors say what to do, never "will be
        #: re-initialised" or "next attempt in": there is no next attempt.
        self._one_shot = one_shot
        # worker thread and hang detection (touched by callers)
        self._submit_lock = threading.Lock()
        self._worker: _Worker | None = None
        self._hung: _Job | None = None
        self._hung_what = ""
        self._hung_since_s = 0.0
        # set on a thread while call_async plans a public method: _call hands the job back instead of running it
        self._planning = threading.local()
        # NVML session (touched only on the worker thread, apart from _needs_reinit)
        self._initialized = False
        self._needs_reinit = False
        self._reload_suspected = False
        self._init_attempts = 0
        self._last_init_attempt_s = 0.0
        self._last_init_error = ""
        self._handles: dict[str, Any] = {}
        self._handle_uuids: dict[int, str] = {}
        self._names: dict[str, str] = {}
        self._infos: dict[str, GpuInfo] = {}
        self._event_set: Any = None
        self._events_supported = True
        self._registered: set[str] = set()
        self._enumerated = False
        self._locked_gpu: dict[str, tuple[int, int]] = {}
        self._locked_memory: dict[str, tuple[int, int]] = {}
        #: Values of the ``_STATIC_GROUPS`` read in this session, by GPU and group, in the order their reader
        #: wrote them: fixed by the board and the driver, so read once per NVML session (again after a re-init
        #: or a driver reload), not every cycle.
        self._static: dict[str, dict[str, tuple[tuple[str, Value], ...]]] = {}
        # knowledge that outlives a session
        #: NotSupported reads: by GPU, the reading group (or ``field:<id>``) and when to ask again (monotonic s);
        #: the fields' entries (``_SESSION_KEYS``) are forgotten when a new NVML session starts
        self._unsupported: dict[str, dict[str, float]] = {}
        self._unsupported_writes: dict[str, set[str]] = {}
        self._legacy_temperature = False
        self._legacy_reasons = False
        #: GPUs whose memory is read with v1 in this NVML session (no v2 in the driver or the binding).
        self._memory_v1: set[str] = set()
        self._lost: dict[str, float] = {}
        #: Process listing function chosen per kind in this NVML session (v3, else v2).
        self._process_fns: dict[str, str] = {}
        #: Per GPU: the newest per-process utilisation sample seen (NVML's CPU timestamp, microseconds).
        self._util_seen_us: dict[str, int] = {}
        self._energy_j: dict[str, float] = {}
        #: The energy counter between its reads, by GPU (``_EnergyTrack``), and the order GPUs were first read
        #: in (which spreads their reads over the read cycle).
        self._energy_tracks: dict[str, _EnergyTrack] = {}
        self._energy_slots: dict[str, int] = {}
        #: Reads of the energy counter that came in below the value already given out (held there), by GPU.
        self.energy_clamps: dict[str, int] = {}
        #: The blocking reads (``_BLOCKING_GROUPS``): their thread (made on first use) and state by (GPU, group).
        self._blocking: _Worker | None = None
        self._blocking_states: dict[tuple[str, str], _BlockingState] = {}
        self._blocking_lock = threading.Lock()
        self._xid_last: dict[str, int] = {}
        self._pending: list[GpuEvent] = []
        # sampling plans: ``_wanted`` by the names a caller passes (callers pass the same few lists again and
        # again), and the bound readers for each wanted set (made on the worker thread)
        self._wanted_sets: _Memo[Hashable, frozenset[str]] = _Memo(_MEMO_SIZE)
        self._steps: tuple[tuple[str, frozenset[str], Step], ...] | None = None
        self._plans: _Memo[frozenset[str], _SamplePlan] = _Memo(_MEMO_SIZE)

    # ==============================================================================================
    # Public API (GpuBackend)
    # ==============================================================================================
    def init(self) -> None:
        """Initialise NVML now (otherwise the first call does). LibraryNotFound -> PermanentError."""
        self._call("nvmlInit", lambda: None)

    def shutdown(self) -> None:
        """Release NVML and the worker thread; a later call initialises again. Never raises: at exit a hung or
        broken NVML must not stop the mapper from stopping."""
        try:
            self._call("nvmlShutdown", self._shutdown_session, needs_session=False)
        except MapperError:
            pass
        finally:
            with self._submit_lock:
                if self._worker is not None:
                    self._worker.stop()
                    self._worker = None
            with self._blocking_lock:
                if self._blocking is not None:
                    self._blocking.stop()
                    self._blocking = None

    def driver_version(self) -> str:
        return self._call("nvmlSystemGetDriverVersion", lambda: _text(self._nv("nvmlSystemGetDriverVersion")))

    def list_gpus(self) -> list[GpuInfo]:
        """Every GPU NVML enumerates now, plus GPUs this backend saw before that are now lost (so their devices
        stay known and can be reported unhealthy)."""
        return self._call("list_gpus", self._list_gpus)

    def sample(self, uuid: str, properties: Iterable[str] | None = None) -> Sample:
        wanted = self._wanted_set(properties)
        return self._call(f"sample of GPU {uuid}", lambda: self._sample(uuid, wanted))

    def sample_many(self, requests: Sequence[tuple[str, Iterable[str] | None]], events: bool = False) -> SampleRound:
        """``sample`` of several GPUs as one NVML job: per request (uuid, properties), in order, its Sample or the
        ``MapperError`` reading it raised (a lost or failing GPU does not stop the others; each GPU gets the
        re-initialise-and-retry-once of a single ``sample``). With ``events``, ``poll_events`` first, in the same
        job (its error, if any, in ``events_error``). Bad property names raise at once, as ``sample``'s.

        The GPUs whose sample reads the driver's energy counter this round (~4 ms of CPU on an H200; one GPU a round
        at most, the reads being spread over the read cycle) are read after the others, so that the dear read
        delays no other GPU's sample."""
        wanted = [(uuid, self._wanted_set(properties)) for uuid, properties in requests]

        def run_all() -> SampleRound:
            started_s = time.monotonic()  # real time, as the job's timeout is
            polled: list[GpuEvent] = []
            events_error: MapperError | None = None
            if events:
                try:
                    polled = self._guarded(self._poll_events, True)
                except MapperError as exc:
                    events_error = exc
            out: list[Sample | MapperError | None] = [None] * len(wanted)
            started = [0.0] * len(wanted)
            monotonic = self._clock.monotonic
            now = monotonic()
            dear = [i for i, (uuid, names) in enumerate(wanted) if self._energy_read_due(uuid, names, now)]
            order = [i for i in range(len(wanted)) if i not in dear] + dear if dear else range(len(wanted))
            for i in order:
                uuid, names = wanted[i]
                started[i] = monotonic()
                try:
                    out[i] = self._guarded(partial(self._sample, uuid, names), True)
                except MapperError as exc:
                    out[i] = exc
            if polled and time.monotonic() - started_s > self._call_timeout_s:
                # A read hung past the job's timeout: the caller has given up on this result, so the events it
                # took from NVML go back to the next poll instead of being lost with it.
                self._pending[:0] = polled
            return SampleRound([x for x in out if x is not None], polled, events_error, tuple(started))

        # Each read above is guarded on its own (init, re-init and retry once, backoff), as a batch of ``sample``
        # calls is: the job as a whole must neither initialise first nor, as a "successful call", reset the
        # re-init backoff after a round in which every read failed.
        return self._call(f"sample of {len(wanted)} GPU(s)", run_all, needs_session=None)

    def constraints(self, uuid: str) -> Constraints:
        return self._call(f"constraints of GPU {uuid}", lambda: self._constraints(uuid))

    def set_power_limit(self, uuid: str, watts: float) -> float:
        """Set the power limit (v1 setter, mW), read it back, return the limit now in force in W."""
        value_w = _number("power_limit", watts)
        limit_mw = round(value_w * 1000)
        return self._call(f"set_power_limit({uuid}, {value_w} W)", lambda: self._set_power_limit(uuid, limit_mw))

    def set_locked_gpu_clocks(self, uuid: str, min_mhz: int, max_mhz: int) -> None:
        """Lock the GPU clock into [min, max] MHz (both from the supported list); 0/0 unlocks."""
        lo, hi = _clock_pair("locked_gpu_clock", min_mhz, max_mhz)
        if (lo, hi) == (0, 0):
            self.reset_locked_gpu_clocks(uuid)
            return
        self._call(f"set_locked_gpu_clocks({uuid}, {lo}, {hi})", lambda: self._set_locked(uuid, "gpu", lo, hi))

    def reset_locked_gpu_clocks(self, uuid: str) -> None:
        self._call(f"reset_locked_gpu_clocks({uuid})", lambda: self._reset_locked(uuid, "gpu"))

    def set_locked_memory_clocks(self, uuid: str, min_mhz: int, max_mhz: int) -> None:
        """Lock the memory clock into [min, max] MHz (both from the supported list); 0/0 unlocks."""
        lo, hi = _clock_pair("locked_memory_clock", min_mhz, max_mhz)
        if (lo, hi) == (0, 0):
            self.reset_locked_memory_clocks(uuid)
            return
        self._call(f"set_locked_memory_clocks({uuid}, {lo}, {hi})", lambda: self._set_locked(uuid, "memory", lo, hi))

    def reset_locked_memory_clocks(self, uuid: str) -> None:
        self._call(f"reset_locked_memory_clocks({uuid})", lambda: self._reset_locked(uuid, "memory"))

    def set_persistence_mode(self, uuid: str, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise InvalidValueError(f"persistence_mode: {enabled!r} is not a boolean (true/false)", reason="wrong-type")
        mode = 1 if enabled else 0
        self._call(
            f"set_persistence_mode({uuid}, {enabled})",
            lambda: self._write(uuid, "persistence_mode", "nvmlDeviceSetPersistenceMode", mode, str(mode)),
        )

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        """Set the compute mode by name: default, exclusive_process or prohibited."""
        if not isinstance(mode, str) or mode.strip().lower() not in COMPUTE_MODES:
            raise InvalidValueError(
                f"compute_mode: {mode!r} is not one of {', '.join(sorted(COMPUTE_MODES))}", reason="unknown-value"
            )
        code = COMPUTE_MODES[mode.strip().lower()]
        self._call(
            f"set_compute_mode({uuid}, {mode})",
            lambda: self._write(uuid, "compute_mode", "nvmlDeviceSetComputeMode", code, f"{mode} ({code})"),
        )

    def processes(self, uuid: str) -> ProcessSample:
        """The GPU's running compute and graphics processes (host PIDs, used memory), their utilisation since
        the previous call, and the GPU's energy counter and power, in one NVML job (``docs/processes.md``)."""
        return self._call(f"processes of GPU {uuid}", lambda: self._processes(uuid))

    def poll_events(self) -> list[GpuEvent]:
        """XID, ECC, GPU-lost and driver-reload events since the last poll (never blocks on NVML)."""
        return self._call("poll_events", self._poll_events)

    def gpu_reset(self, uuid: str) -> None:
        """One GPU was reset outside NVML (``nvidia-smi -r``): forget what this backend set on it (its locked
        clocks), its board values read this session and its energy counter's baseline, so the reconciler sets it
        again and the counter's restart at 0 is not taken for a driver reload of the whole node."""
        self._call(f"gpu_reset({uuid})", lambda: self._forget_gpu(uuid), needs_session=None)

    def _forget_gpu(self, uuid: str) -> None:
        self._locked_gpu.pop(uuid, None)
        self._locked_memory.pop(uuid, None)
        self._static.pop(uuid, None)
        self._energy_j.pop(uuid, None)
        self._energy_tracks.pop(uuid, None)

    def driver_checks(self, uuid: str, deadline_s: float) -> tuple[CheckResult, ...]:
        """The level-2 checks NVML answers for one GPU (``docs/health.md``): ``nvml-responsive`` (its calls here
        answered within ``deadline_s``; the detail carries NVML's driver version) and ``inforom``
        (``nvmlDeviceValidateInforom``, with the image and object versions). A call that does not answer within
        the backend's own timeout raises TransientError, as every call does."""
        return self._call(f"driver checks of GPU {uuid}", lambda: self._driver_checks(uuid, deadline_s))

    def _wanted_set(self, properties: Iterable[str] | None) -> frozenset[str]:
        """``_wanted(properties)``, remembered for a tuple, list, set, frozenset or string of names."""
        if properties is None:
            return _ALL_NVML
        key: Hashable
        if isinstance(properties, tuple | frozenset | str):
            key = properties
        elif isinstance(properties, list):
            key = tuple(properties)
        elif isinstance(properties, set):
            key = frozenset(properties)
        else:  # another iterable (a generator, a dict view): may not give the same names twice
            return _wanted(properties)
        known = self._wanted_sets.get(key)
        if known is None:
            known = self._wanted_sets.put(key, _wanted(key))
        return known

    # --- introspection for tests and the composition root -----------------------------------------
    def locked_clocks(self, uuid: str) -> dict[str, int]:
        """The locked clocks this backend set since the current NVML init (0 = not locked)."""
        gpu = self._locked_gpu.get(uuid, (0, 0))
        mem = self._locked_memory.get(uuid, (0, 0))
        return {
            "locked_gpu_clock_min": gpu[0],
            "locked_gpu_clock_max": gpu[1],
            "locked_memory_clock_min": mem[0],
            "locked_memory_clock_max": mem[1],
        }

    def is_lost(self, uuid: str) -> bool:
        return uuid in self._lost

    @property
    def nvml(self) -> Any:
        """The nvml module this backend calls (``pynvml`` or a ``SimNvml``), for the composition root."""
        return self._nvml

    # ==============================================================================================
    # Async entry, worker thread, timeouts, init
    # ==============================================================================================
    # --- async entry ----------------------------------------------------------------------------------
    @overload
    async def call_async(self, method: Callable[..., T], *args: Any) -> T: ...

    @overload
    async def call_async(self, method: str, *args: Any) -> Any: ...

    async def call_async(self, method: Callable[..., Any] | str, *args: Any) -> Any:
        """``await backend.call_async(backend.sample, uuid, props)``: the public method ``method`` (bound to this
        backend, or its name) with ``args``, its NVML work run on the worker thread while the event loop waits
        without a thread of its own. Same results, errors, timeouts (``call_timeout_s``, ``init_timeout_s``) and
        hung-call handling as the blocking call. Argument checks run on the caller's thread, as they do there.

        Calls made in the same event-loop iteration (GPU loops woken by the same collect cycle) go to the worker
        as one job: one thread wake-up and one loop wake-up for all of them. Each still gets its own result or
        error; they share one timeout. Cancelling the await skips a call that has not started; one already
        inside NVML runs to its end."""
        bound = self._public_method(method)
        self._planning.active = True
        try:
            immediate = bound(*args)
        except _Planned as planned:
            item = planned
        else:
            return immediate  # nothing for the worker (e.g. locked_clocks, is_lost)
        finally:
            self._planning.active = False
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Any] = loop.create_future()
        pending = getattr(self._planning, "batch", None)
        if pending is None or pending[0] is not loop:  # (a batch left by a loop that stopped is dropped)
            batch: list[tuple[_Planned, asyncio.Future[Any]]] = []
            pending = self._planning.batch = (loop, batch)
            loop.call_soon(self._flush, loop, batch)
        pending[1].append((item, waiter))
        try:
            return await waiter
        except asyncio.CancelledError:
            item.cancelled = True
            raise

    def _flush(self, loop: asyncio.AbstractEventLoop, batch: list[tuple[_Planned, asyncio.Future[Any]]]) -> None:
        """Hand the calls ``call_async`` collected in one loop iteration to the worker as one job."""
        pending = getattr(self._planning, "batch", None)
        if pending is not None and pending[1] is batch:
            self._planning.batch = None
        items = [(planned, waiter) for planned, waiter in batch if not waiter.done()]
        if not items:
            return
        outcomes: list[tuple[bool, Any] | None] = [None] * len(items)
        at = [0]  # the call the worker is in (names a hung call)

        def run_all() -> None:  # on the worker thread
            for i, (planned, _) in enumerate(items):
                at[0] = i
                if planned.cancelled:
                    continue
                try:
                    outcomes[i] = (True, self._guarded(planned.fn, planned.needs_session))
                except Exception as exc:
                    outcomes[i] = (False, exc)

        settled = [False]

        def settle(finished: bool) -> None:  # on the loop
            if settled[0]:
                return
            settled[0] = True
            timer.cancel()
            expired: bool | None = None  # None: the job finished; else whether it had not started
            if not (finished or job.finished):
                expired = self._expire(job, worker, items[at[0]][0].what, timeout_s)
            for (planned, waiter), outcome in zip(items, outcomes, strict=True):
                if waiter.done():
                    continue
                if outcome is not None:
                    ok, value = outcome
                    if ok:
                        waiter.set_result(value)
                    else:
                        waiter.set_exception(value)
                elif expired is not None:
                    waiter.set_exception(self._timeout_error(planned.what, timeout_s, expired))
                else:
                    error = job.error if job.error is not None else TransientError(f"{planned.what}: not run")
                    waiter.set_exception(error)

        def on_done() -> None:  # on the worker thread
            try:
                loop.call_soon_threadsafe(settle, True)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting any more

        what = items[0][0].what if len(items) == 1 else f"{items[0][0].what} and {len(items) - 1} more calls"
        try:
            job, worker, timeout_s = self._submit(what, run_all, on_done)
        except TransientError:
            for planned, waiter in items:
                waiter.set_exception(self._not_attempted(planned.what))
            return
        timer = loop.call_later(timeout_s, settle, False)

    def _public_method(self, method: Callable[..., Any] | str) -> Callable[..., Any]:
        name = method if isinstance(method, str) else getattr(method, "__name__", "")
        if not isinstance(method, str) and getattr(method, "__self__", None) is not self:
            raise TypeError(f"call_async: {method!r} is not a method of this NvmlBackend")
        if name.startswith("_") or name in _NOT_ASYNC or not callable(getattr(type(self), name, None)):
            raise TypeError(f"call_async: {name!r} is not a public NvmlBackend method it can run")
        if name == "call_async":
            raise TypeError("call_async: cannot run call_async itself")
        bound: Callable[..., Any] = getattr(self, name)
        return bound

    # --- worker thread, timeouts, init --------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T], *, needs_session: bool | None = True) -> T:
        if getattr(self._planning, "active", False):
            self._planning.active = False
            raise _Planned(what, fn, needs_session)
        job, worker, timeout_s = self._submit(what, lambda: self._guarded(fn, needs_session))
        if job.wait(timeout_s):
            if job.error is not None:
                raise job.error
            result: T = job.result
            return result
        raise self._timeout_error(what, timeout_s, self._expire(job, worker, what, timeout_s))

    def _submit(
        self, what: str, job_fn: Callable[[], Any], on_done: Callable[[], None] | None = None
    ) -> tuple[_Job, _Worker, float]:
        """Queue ``job_fn`` on the worker; the job, that worker, and how long to wait for it."""
        with self._submit_lock:
            hung = self._hung
            if hung is not None:
                if not hung.finished:
                    raise self._not_attempted(what)
                self._hung = None
            if self._worker is None:
                self._worker = _Worker()
            fresh = not self._initialized or self._needs_reinit
            timeout_s = max(self._call_timeout_s, self._init_timeout_s) if fresh else self._call_timeout_s
            job = self._worker.submit(job_fn, on_done)
            return job, self._worker, timeout_s

    def _not_attempted(self, what: str) -> TransientError:
        waited = self._clock.monotonic() - self._hung_since_s
        return TransientError(
            f"{what} not attempted: NVML has not answered {self._hung_what} for {waited:.1f} s",
            retry_after_s=self._call_timeout_s,
        )

    def _expire(self, job: _Job, worker: _Worker, what: str, timeout_s: float) -> bool:
        """A job not done in time: True when it had not started (now cancelled); otherwise it is marked hung,
        later calls fail fast until it returns, and NVML is re-initialised after that."""
        if worker.cancel(job):
            return True
        with self._submit_lock:
            self._hung = job
            self._hung_what = what
            self._hung_since_s = self._clock.monotonic() - timeout_s
            self._needs_reinit = True
        return False

    def _timeout_error(self, what: str, timeout_s: float, cancelled: bool) -> TransientError:
        if cancelled:
            return TransientError(f"{what}: NVML busy for {timeout_s} s with other calls", retry_after_s=timeout_s)
        if self._one_shot:
            return TransientError(
                f"{what}: no answer from NVML within {timeout_s} s; check that nvidia-smi answers (a GPU without "
                "persistence mode can take seconds to wake; nvidia-persistenced avoids that)",
                retry_after_s=timeout_s,
            )
        return TransientError(
            f"{what}: no answer from NVML within {timeout_s} s; NVML will be re-initialised",
            retry_after_s=timeout_s,
        )

    def _guarded(self, fn: Callable[[], T], needs_session: bool | None) -> T:
        """``fn()`` with NVML initialised first (``needs_session``), re-initialised and retried once when the session
        died under it, and the re-init backoff reset when it succeeds. ``needs_session`` None: ``fn`` guards each
        of its calls itself (``sample_many``), nothing is added."""
        if needs_session is None:
            return fn()
        if needs_session:
            self._ensure_init()
        try:
            result = fn()
        except GpuLostError:
            raise
        except TransientError:
            # The session died under this call (e.g. Uninitialized after a driver reload). When no re-init has
            # failed recently, re-initialise at once and try the call once more, so one reload costs one error
            # at most; otherwise the backoff in _ensure_init applies to the next call.
            if not (needs_session and self._needs_reinit and self._init_attempts <= 1):
                raise
            self._init_attempts = 0
            self._ensure_init()
            result = fn()
        self._init_attempts = 0  # a call succeeded: the next re-init may start at once
        return result

    def _ensure_init(self) -> None:
        if self._initialized and not self._needs_reinit:
            return
        now = self._clock.monotonic()
        if self._init_attempts:
            wait_s = min(self._backoff_max_s, self._backoff_s * 2 ** (self._init_attempts - 1))
            left_s = self._last_init_attempt_s + wait_s - now
            if left_s > 0:
                raise TransientError(
                    f"NVML re-initialisation backs off {left_s:.1f} s more (last problem: {self._last_init_error})",
                    retry_after_s=left_s,
                )
        if self._initialized:
            self._shutdown_session()
        self._init_attempts += 1
        self._last_init_attempt_s = now
        self._reset_session()
        try:
            self._nvml.nvmlInitWithFlags(self._init_flags)
        except self._nvml_error as exc:
            error = self._init_error(exc)
            self._last_init_error = str(error)
            if self._one_shot and not isinstance(error, PermanentError):
                raise PermanentError(str(error)) from exc
            if isinstance(error, TransientError):
                wait_s = min(self._backoff_max_s, self._backoff_s * 2 ** (self._init_attempts - 1))
                raise TransientError(f"{error}; next attempt in {wait_s:.1f} s", retry_after_s=wait_s) from exc
            raise error from exc
        self._initialized = True
        self._needs_reinit = False
        if self._reload_suspected:
            self._reload_suspected = False
            self._report_reload("NVML reported Uninitialized on a live session")

    def _reset_session(self) -> None:
        self._handles.clear()
        self._handle_uuids.clear()
        self._registered.clear()
        self._event_set = None
        self._enumerated = False
        self._locked_gpu.clear()
        self._locked_memory.clear()
        self._static.clear()
        self._memory_v1.clear()
        # a reload may have brought a newer driver: try the current names and the fields again (once per session)
        self._legacy_temperature = False
        self._legacy_reasons = False
        for memo in self._unsupported.values():
            for key in _SESSION_KEYS:
                memo.pop(key, None)
        self._process_fns.clear()
        self._blocking_states.clear()  # (a read still running answers into a state nobody reads any more)

    def _shutdown_session(self) -> None:
        if not self._initialized:
            return
        self._initialized = False
        nvml = self._nvml
        if self._event_set is not None:
            try:
                nvml.nvmlEventSetFree(self._event_set)
            except self._nvml_error:
                pass
            self._event_set = None
        try:
            nvml.nvmlShutdown()
        except self._nvml_error:
            pass

    def _report_reload(self, why: str) -> None:
        """A driver reload happened: forget what we set, probe lost GPUs again, tell the loops."""
        self._locked_gpu.clear()
        self._locked_memory.clear()
        self._static.clear()
        self._lost.clear()
        self._energy_j.clear()
        self._energy_tracks.clear()
        ts = self._clock.wall_ms()
        for uuid in sorted(set(self._infos) | set(self._names)):
            self._pending.append(GpuEvent(uuid=uuid, ts_ms=ts, kind="driver_reload", detail=why))

    # ==============================================================================================
    # The choke point: every NVML call, every translation
    # ==============================================================================================
    def _nv(
        self,
        fname: str,
        *args: Any,
        uuid: str = "",
        value: object = None,
        invalid_reason: str = "out-of-range",
    ) -> Any:
        fn = getattr(self._nvml, fname, None)
        if fn is None:
            raise _FunctionMissing(f"{_where(uuid)}{fname} is not in this NVML binding")
        try:
            return fn(*args)
        except self._nvml_error as exc:
            raise self._translate(exc, fname, uuid, value, invalid_reason) from exc

    def _init_error(self, exc: Exception) -> MapperError:
        """nvmlInit failed: one line with the cause and what to do about it. LibraryNotFound is permanent,
        NoPermission a NoPermissionError; everything else may pass (a driver being loaded, a container restarted)."""
        code = int(getattr(exc, "value", _UNKNOWN))
        if code == _LIBRARY_NOT_FOUND:
            return self._translate(exc, "nvmlInit", "", None, "")
        advice = _INIT_ADVICE.get(code, _INIT_ADVICE_OTHER)
        text = f"NVML could not start: nvmlInit failed: {exc} (NVML error {code}). {advice}"
        if code == _NO_PERMISSION:
            return NoPermissionError(text)
        return TransientError(text, retry_after_s=self._backoff_s)

    def _translate(self, exc: Exception, fname: str, uuid: str, value: object, invalid_reason: str) -> MapperError:
        code = int(getattr(exc, "value", _UNKNOWN))
        shown = "" if value is None else str(value)
        text = f"{_where(uuid)}{fname}({shown}) failed: {exc} (NVML error {code})"
        if code in _SESSION_ERRORS:
            if code == _UNINITIALIZED and self._initialized:
                self._reload_suspected = True
            self._needs_reinit = True
            if self._one_shot:
                return TransientError(text, retry_after_s=self._backoff_s)
            return TransientError(text + "; NVML will be re-initialised", retry_after_s=self._backoff_s)
        if code == _TIMEOUT:
            return TransientError(text)
        if code == _GPU_IS_LOST:
            self._mark_lost(uuid, f"{fname} reported GpuIsLost")
            return GpuLostError(text + "; the GPU fell off the bus (needs a reboot)")
        if code == _INVALID_ARGUMENT:
            return InvalidValueError(text, reason=invalid_reason)
        if code == _FREQ_NOT_SUPPORTED:
            return InvalidValueError(text, reason="not-supported-clock")
        if code == _FUNCTION_NOT_FOUND:
            return _FunctionMissing(text + " (the driver is older than the binding)")
        if code in (_NOT_SUPPORTED, _DEPRECATED):
            return UnsupportedError(text)
        if code == _NO_PERMISSION:
            return NoPermissionError(text + " (NVML setters need root)")
        if code == _LIBRARY_NOT_FOUND:
            return PermanentError(
                f"NVML library {LIBRARY_NAME} not found: {fname} failed ({exc}). Install the NVIDIA driver, or make "
                f"{LIBRARY_NAME} visible to this container (NVIDIA container toolkit); use --sim for simulated GPUs"
            )
        if code in (_NOT_FOUND, _GPU_NOT_FOUND):
            return NotFoundError(text)
        return PermanentError(text)

    def _mark_lost(self, uuid: str, why: str) -> None:
        if not uuid:
            return
        first = uuid not in self._lost
        self._lost[uuid] = self._clock.monotonic()
        self._handles.pop(uuid, None)
        if first:
            self._needs_reinit = True  # once for the session; later probes do not re-init again
            self._pending.append(GpuEvent(uuid=uuid, ts_ms=self._clock.wall_ms(), kind="gpu_lost", detail=why))

    # ==============================================================================================
    # Level-2 health checks
    # ==============================================================================================
    def _driver_checks(self, uuid: str, deadline_s: float) -> tuple[CheckResult, ...]:
        started = time.perf_counter()
        handle = self._handle(uuid)
        driver = _text(self._nv("nvmlSystemGetDriverVersion"))
        inforom = self._inforom(handle, uuid)
        took_s = time.perf_counter() - started
        detail = (("driver_version", driver), ("took_ms", f"{took_s * 1000:.0f}"))
        if took_s > deadline_s:
            responsive = CheckResult(
                "nvml-responsive", "degraded", f"nvml-slow-{took_s * 1000:.0f}ms", "driver", detail
            )
        else:
            responsive = CheckResult("nvml-responsive", "healthy", "ok", "driver", detail)
        return responsive, inforom

    def _inforom(self, handle: Any, uuid: str) -> CheckResult:
        versions: list[tuple[str, str]] = []
        for key, call, args in (
            ("image_version", "nvmlDeviceGetInforomImageVersion", ()),
            ("oem_version", "nvmlDeviceGetInforomVersion", (_INFOROM_OEM,)),
            ("ecc_version", "nvmlDeviceGetInforomVersion", (_INFOROM_ECC,)),
            ("power_version", "nvmlDeviceGetInforomVersion", (_INFOROM_POWER,)),
        ):
            try:
                versions.append((key, _text(self._nv(call, handle, *args, uuid=uuid))))
            except UnsupportedError:
                versions.append((key, "N/A"))
        fn = getattr(self._nvml, "nvmlDeviceValidateInforom", None)
        if fn is None:
            return CheckResult("inforom", "healthy", "not-checked-no-binding", "inforom", tuple(versions))
        try:
            fn(handle)
        except self._nvml_error as exc:
            code = int(getattr(exc, "value", _UNKNOWN))
            if code == _CORRUPTED_INFOROM:
                return CheckResult("inforom", "unhealthy", "inforom-corrupted", "inforom", tuple(versions))
            if code in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND, _DEPRECATED):
                return CheckResult("inforom", "healthy", "not-supported", "inforom", tuple(versions))
            raise self._translate(exc, "nvmlDeviceValidateInforom", uuid, None, "") from exc
        return CheckResult("inforom", "healthy", "ok", "inforom", tuple(versions))

    # ==============================================================================================
    # Handles, enumeration, events
    # ==============================================================================================
    def _handle(self, uuid: str) -> Any:
        lost_at = self._lost.get(uuid)
        if lost_at is not None:
            if self._clock.monotonic() < lost_at + self._lost_retry_s:
                raise GpuLostError(
                    f"GPU {uuid} is lost (fell off the bus); probing again every {self._lost_retry_s:.0f} s"
                )
            self._handles.pop(uuid, None)  # probe: attach to it afresh
        handle = self._handles.get(uuid)
        if handle is not None:
            return handle
        try:
            handle = self._nv("nvmlDeviceGetHandleByUUID", uuid, uuid=uuid, value=uuid)
        except NotFoundError:
            raise NotFoundError(f"GPU {uuid} is not on this node (nvmlDeviceGetHandleByUUID: not found)") from None
        except InvalidValueError:
            raise NotFoundError(f"GPU {uuid!r} is not a GPU UUID NVML knows (nvmlDeviceGetHandleByUUID)") from None
        if uuid not in self._names:
            self._names[uuid] = _text(self._nv("nvmlDeviceGetName", handle, uuid=uuid))
        self._remember_handle(uuid, handle)
        self._lost.pop(uuid, None)
        return handle

    def _remember_handle(self, uuid: str, handle: Any) -> None:
        self._handles[uuid] = handle
        self._handle_uuids[_handle_key(handle)] = uuid
        self._register_events(uuid, handle)

    def _list_gpus(self) -> list[GpuInfo]:
        driver = _text(self._nv("nvmlSystemGetDriverVersion"))
        count = int(self._nv("nvmlDeviceGetCount"))
        seen: list[GpuInfo] = []
        for index in range(count):
            try:
                handle = self._nv("nvmlDeviceGetHandleByIndex", index, value=index)
                uuid = _text(self._nv("nvmlDeviceGetUUID", handle, value=f"index {index}"))
            except (GpuLostError, PermanentError):
                continue  # a lost GPU cannot tell its UUID; it is listed below from what we knew
            name = _text(self._nv("nvmlDeviceGetName", handle, uuid=uuid))
            info = GpuInfo(
                uuid=uuid,
                index=index,
                name=name,
                pci_bus_id=self._optional_text("nvmlDeviceGetPciInfo", handle, uuid, "busId"),
                serial=self._optional_text("nvmlDeviceGetSerial", handle, uuid),
                driver_version=driver,
                architecture=self._architecture(handle, uuid),
            )
            self._infos[uuid] = info
            self._names[uuid] = name
            if uuid not in self._handles:
                self._remember_handle(uuid, handle)
            seen.append(info)
        self._enumerated = True
        listed = {g.uuid for g in seen}
        seen.extend(info for uuid, info in self._infos.items() if uuid not in listed and uuid in self._lost)
        return seen

    def _optional_text(self, call: str, handle: Any, uuid: str, attribute: str = "") -> str:
        try:
            result = self._nv(call, handle, uuid=uuid)
        except UnsupportedError:
            return ""
        return _text(getattr(result, attribute) if attribute else result)

    def _architecture(self, handle: Any, uuid: str) -> str:
        try:
            return ARCHITECTURES.get(int(self._nv("nvmlDeviceGetArchitecture", handle, uuid=uuid)), "")
        except UnsupportedError:
            return ""

    def _ensure_event_set(self) -> Any:
        if self._event_set is None and self._events_supported:
            try:
                self._event_set = self._nv("nvmlEventSetCreate")
            except UnsupportedError:
                self._events_supported = False
        return self._event_set

    def _register_events(self, uuid: str, handle: Any) -> None:
        if uuid in self._registered:
            return
        event_set = self._ensure_event_set()
        if event_set is None:
            return
        try:
            supported = int(self._nv("nvmlDeviceGetSupportedEventTypes", handle, uuid=uuid))
            mask = supported & _EV_WANTED
            if mask:
                self._nv("nvmlDeviceRegisterEvents", handle, mask, event_set, uuid=uuid, value=hex(mask))
        except (UnsupportedError, NoPermissionError):
            pass
        self._registered.add(uuid)

    def _poll_events(self) -> list[GpuEvent]:
        if not self._enumerated:
            self._list_gpus()
        event_set = self._ensure_event_set()
        nvml = self._nvml
        if event_set is not None:
            for _ in range(10_000):
                try:
                    data = nvml.nvmlEventSetWait(event_set, 0)
                except self._nvml_error as exc:
                    if int(getattr(exc, "value", 0)) == _TIMEOUT:
                        break
                    raise self._translate(exc, "nvmlEventSetWait", "", "0 ms", "out-of-range") from exc
                self._on_event(data)
        events, self._pending = self._pending, []
        return events

    def _on_event(self, data: Any) -> None:
        uuid = self._handle_uuids.get(_handle_key(data.device), "")
        if not uuid:
            try:
                uuid = _text(self._nv("nvmlDeviceGetUUID", data.device))
            except MapperError:
                uuid = ""
        ts = self._clock.wall_ms()
        event_type = int(data.eventType)
        if event_type & _EV_XID:
            xid = int(data.eventData)
            if uuid:
                self._xid_last[uuid] = xid
            self._pending.append(GpuEvent(uuid=uuid, ts_ms=ts, kind="xid", xid=xid, detail=f"XID {xid}"))
            if xid == 79 and uuid:
                self._mark_lost(uuid, "XID 79: GPU fell off the bus")
        elif event_type & _EV_DBE:
            self._pending.append(GpuEvent(uuid=uuid, ts_ms=ts, kind="ecc_double", detail="double-bit ECC error"))
        elif event_type & _EV_SBE:
            self._pending.append(GpuEvent(uuid=uuid, ts_ms=ts, kind="ecc_single", detail="single-bit ECC error"))

    # ==============================================================================================
    # Sampling
    # ==============================================================================================
    def _sample(self, uuid: str, wanted: frozenset[str]) -> Sample:
        handle = self._handle(uuid)
        plan = self._plans.get(wanted) or self._plan(wanted)
        values: dict[str, Value] = {}
        errors: dict[str, str] = {}
        now = self._clock.monotonic()
        unsupported = self._unsupported.get(uuid)  # retry times by group (None: nothing unsupported yet)
        static = self._static.get(uuid)
        for group, props, step in plan.steps:
            if unsupported:
                retry_at = unsupported.get(group)
                if retry_at is not None:
                    if now < retry_at:
                        continue
                    del unsupported[group]
            if static is not None and group in static:
                values.update(static[group])  # in the order the reader wrote them
                continue
            try:
                step(handle, uuid, values, errors)
            except UnsupportedError:
                if unsupported is None:
                    unsupported = self._unsupported.setdefault(uuid, {})
                unsupported[group] = now + self._unsupported_retry_s
            except (TransientError, NotFoundError):
                raise
            except PermanentError as exc:
                for prop in props:
                    errors[prop] = f"{exc.reason}: {exc}"
            else:
                if group in _STATIC_GROUPS:
                    if static is None:
                        static = self._static.setdefault(uuid, {})
                    static[group] = tuple((k, v) for k, v in values.items() if k in props)
        if self._blocking_states:
            self._prefetch_blocking(uuid, handle, now)
        if not plan.exact:  # a reader also wrote values of its group that were not asked for
            values = {k: v for k, v in values.items() if k in wanted}
            if errors:
                errors = {k: v for k, v in errors.items() if k in wanted}
        return Sample(uuid=uuid, ts_ms=self._clock.wall_ms(), values=values, errors=errors)

    def _plan(self, wanted: frozenset[str]) -> _SamplePlan:
        """The reading plan for ``wanted``, made once per set of names (on the worker thread)."""
        steps = self._steps
        if steps is None:
            steps = self._steps = tuple(
                (group, props, self._blocking_step(group) if self._is_blocking(group) else _bind(reader, self))
                for group, props, reader in _GROUPS
            )
        chosen = tuple(entry for entry in steps if not wanted.isdisjoint(entry[1]))
        return self._plans.put(wanted, _SamplePlan(chosen, wanted))

    # --- blocking reads, on a thread of their own (``_BLOCKING_GROUPS``) ------------------------------------
    def _is_blocking(self, group: str) -> bool:
        return self._blocking_thread and group in _BLOCKING_GROUPS

    def _blocking_step(self, group: str) -> Step:
        return partial(self._serve_blocking, group)

    def _serve_blocking(self, group: str, h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
        """A blocking group asked for: the value its own thread read at most ``_BLOCKING_FRESH_S`` ago (started
        ``_BLOCKING_LEAD_S`` before this ask by ``_prefetch_blocking``). The first ask (of this GPU and group in
        the NVML session) starts a read and waits for it (``_BLOCKING_FIRST_WAIT_S`` at most: once, at start-up).
        A later ask that finds no fresh value gets an error entry saying so (the value is absent, not stale; the
        read before the next ask is started ahead of it). NotSupported raises UnsupportedError, as a read here
        would."""
        now = self._clock.monotonic()
        getter = _BLOCKING_GETTERS[group]
        with self._blocking_lock:
            state = self._blocking_states.get((uuid, group))
            first = state is None
            if state is None:
                state = self._blocking_states[(uuid, group)] = _BlockingState(_BLOCKING_PERIOD_GUESS_S[group])
            elif now > state.asked_s:
                state.period_s = now - state.asked_s
            state.asked_s = now
            outcome = state.outcome if now - state.outcome_s <= _BLOCKING_FRESH_S else None
            start = outcome is None and first and not state.running
            if start:
                state.running = True
                state.started_s = now
                state.done.clear()
        if start:
            self._start_blocking(state, getter, h, now)
        if outcome is None and first:
            state.done.wait(_BLOCKING_FIRST_WAIT_S)
            with self._blocking_lock:
                outcome = state.outcome
        if outcome is None:
            for prop in getter.props:
                errors[prop] = f"{getter.call} is read on a thread of its own (it blocks): in a later sample"
            return
        ok, raw = outcome
        if ok:
            value = getter.convert(raw)
            if len(getter.props) == 1:
                out[getter.props[0]] = value
            else:
                out[getter.props[0]], out[getter.props[1]] = value
            return
        code = int(getattr(raw, "value", -1))
        text = f"{_where(uuid)}{getter.call} failed on its own thread: {raw}"
        if code in (_NOT_SUPPORTED, _DEPRECATED, _FUNCTION_NOT_FOUND):
            with self._blocking_lock:  # asked again at its retry time as a first ask (a read waited for)
                self._blocking_states.pop((uuid, group), None)
            raise UnsupportedError(text)
        for prop in getter.props:
            errors[prop] = text  # (GPU lost, a session gone: the reads of the shared round find those themselves)

    def _prefetch_blocking(self, uuid: str, h: Any, now: float) -> None:
        """Start each blocking read of this GPU whose group is expected to be asked for within ``_BLOCKING_LEAD_S``
        (its last ask plus the interval between its last two asks, at first its catalog collect cycle) and that
        has no read started for that ask yet, so that the ask finds a value about a second old."""
        for group in _BLOCKING_GROUPS:
            state = self._blocking_states.get((uuid, group))
            if state is None:
                continue
            with self._blocking_lock:
                ahead_s = state.asked_s + state.period_s - _BLOCKING_LEAD_S
                if state.running or now < ahead_s or state.started_s >= ahead_s:
                    continue
                state.running = True
                state.started_s = now
                state.done.clear()
            self._start_blocking(state, _BLOCKING_GETTERS[group], h, now)

    def _start_blocking(self, state: _BlockingState, getter: _Getter, h: Any, started_s: float) -> None:
        """Queue ``getter``'s NVML call on the blocking reads' thread; its outcome lands in ``state``, stamped with
        ``started_s`` (when it was asked for)."""
        nvml = self._nvml
        nvml_error = self._nvml_error
        lock = self._blocking_lock

        def read() -> None:
            try:
                fn = getattr(nvml, getter.call)
                outcome: tuple[bool, Any] = (True, fn(h, *(getattr(nvml, c) for c in getter.constants)))
            except nvml_error as exc:
                outcome = (False, exc)
            except Exception as exc:  # (a bug or a missing name: an error entry at the ask, not a dead thread)
                outcome = (False, exc)
            with lock:
                state.outcome = outcome
                state.outcome_s = started_s
                state.running = False
            state.done.set()

        with lock:
            if self._blocking is None:
                self._blocking = _Worker("nvml-blocking")
            lane = self._blocking
        lane.submit(read)

    # Each reader makes ONE NVML call (or none) and fills ``out`` in catalog units.
    def _r_identity(self, h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
        out["uuid"] = uuid
        out["product_name"] = self._names.get(uuid, "")

    def _r_temperature(self, h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
        sensor = self._nvml.NVML_TEMPERATURE_GPU
        if not self._legacy_temperature:
            try:
                out["temperature"] = int(self._nv("nvmlDeviceGetTemperatureV", h, sensor, uuid=uuid))
                return
            except _FunctionMissing:
                self._legacy_temperature = True  # driver older than nvmlDeviceGetTemperatureV
        out["temperature"] = int(self._nv("nvmlDeviceGetTemperature", h, sensor, uuid=uuid))

    def _r_memory(self, h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
        """``nvmlDeviceGetMemoryInfo(h, version=nvmlMemory_v2)``: used, reserved and total apart. v1 where the
        driver (before r510) or the binding has no v2; v1's ``used`` includes the reserved part, and
        ``memory_reserved`` is then absent."""
        nvml = self._nvml
        if uuid not in self._memory_v1:
            version = getattr(nvml, "nvmlMemory_v2", None)
            fn = getattr(nvml, "nvmlDeviceGetMemoryInfo", None)
            if version is not None and fn is not None:
                try:
                    mem = fn(h, version=version)
                except self._nvml_error as exc:
                    if int(getattr(exc, "value", _UNKNOWN)) not in _MEMORY_V2_ABSENT:
                        raise self._translate(exc, "nvmlDeviceGetMemoryInfo", uuid, "nvmlMemory_v2", "") from exc
                else:
                    out["memory_used"] = int(mem.used)
                    out["memory_total"] = int(mem.total)
                    out["memory_reserved"] = int(mem.reserved)
                    return
            self._memory_v1.add(uuid)  # for this NVML session
        mem = self._nv("nvmlDeviceGetMemoryInfo", h, uuid=uuid)
        out["memory_used"] = int(mem.used)
        out["memory_total"] = int(mem.total)

    def _r_reasons(self, h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
        """``nvmlDeviceGetCurrentClocksEventReasons`` (r535+), else its older name ``...ClocksThrottleReasons``
        (the same bits)."""
        if not self._legacy_reasons:
            try:
                mask = self._nv("nvmlDeviceGetCurrentClocksEventReasons", h, uuid=uuid)
            except _FunctionMissing:
                self._legacy_reasons = True  # driver (or binding) older than the event-reasons name
            else:
                out["clock_event_reasons"], out["clock_event_reasons_text"] = _reasons(mask)
                return
        mask = self._nv("nvmlDeviceGetCurrentClocksThrottleReasons", h, uuid=uuid)
        out["clock_event_reasons"], out["clock_event_reasons_text"] = _reasons(mask)

    def _r_memory_temperature(self, h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
        """Field 82 in a call of its own (with energy in the same call it would cost what the energy counter
        costs)."""
        (item,) = self._nv("nvmlDeviceGetFieldValues", h, [_FI_MEMORY_TEMP], uuid=uuid, value=[_FI_MEMORY_TEMP])
        status = int(item.nvmlReturn)
        if status == 0:
            out["temperature_memory"] = int(_field_number(item))
        elif status in _FIELD_ABSENT:
            raise UnsupportedError(f"GPU {uuid}: no memory temperature (field {_FI_MEMORY_TEMP}: NVML error {status})")
        elif status == _GPU_IS_LOST:
            raise self._translate(self._nvml_error(status), "nvmlDeviceGetFieldValues", uuid, _FI_MEMORY_TEMP, "")
        else:
            errors["temperature_memory"] = f"nvmlDeviceGetFieldValues field {_FI_MEMORY_TEMP}: NVML error {status}"

    def _r_energy(self, h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
        """``energy_consumption`` and its age (``_energy``), with the power this sample read (it reads its groups in
        ``_GROUPS`` order, power_usage first) or, where power was not asked for, a power reading of its own."""
        power = out.get("power_usage")
        power_w = float(power) if isinstance(power, int | float) and not isinstance(power, bool) else None
        if power_w is None:
            power_w = self._power_for_energy(h, uuid)
        energy_j, age_s = self._energy(h, uuid, self._clock.monotonic(), power_w)
        out["energy_consumption"] = energy_j
        out["energy_consumption_age"] = age_s

    def _power_for_energy(self, h: Any, uuid: str) -> float | None:
        """Power (W) to integrate the energy counter with, or None where there is none (NotSupported: remembered
        as the power_usage group's)."""
        memo = self._unsupported.get(uuid)
        if memo and self._clock.monotonic() < memo.get("power_usage", -1.0):
            return None
        try:
            return int(self._nv("nvmlDeviceGetPowerUsage", h, uuid=uuid)) / 1000.0
        except UnsupportedError:
            self._unsupported.setdefault(uuid, {})["power_usage"] = self._clock.monotonic() + self._unsupported_retry_s
            return None

    def _energy_read_due(self, uuid: str, names: frozenset[str], now: float) -> bool:
        """Whether a sample of ``names`` now would read the driver's energy counter (not derive it)."""
        if "energy_consumption" not in names and "energy_consumption_age" not in names:
            return False
        track = self._energy_tracks.get(uuid)
        return track is None or now >= track.next_read_s

    def _energy(
        self, h: Any, uuid: str, now: float, power_w: float | None, *, may_read: bool = True
    ) -> tuple[float, float]:
        """The GPU's energy counter (J) and how long ago it was read from the driver (s). The driver's counter is
        read every ``energy_read_s`` (each GPU at its own offset within that cycle, so that their reads, ~4 ms of
        CPU each on an H200, fall in different rounds); in between the value is the last read plus ``power_w``
        integrated since (``_EnergyTrack``). Without a power reading every call reads the driver's counter.
        ``may_read`` False (the process cycle): a read that is due is left to the next collect sample, which is
        on the collect grid and read after the other GPUs of its round (unless ``energy_read_s`` is 0: every call
        reads the counter, the process cycle's too)."""
        track = self._energy_tracks.get(uuid)
        if (
            track is not None
            and power_w is not None
            and (now < track.next_read_s or (not may_read and self._energy_read_s > 0))
        ):
            return track.derive(now, power_w), now - track.read_s
        energy_j = self._read_energy(h, uuid, now)
        self._check_energy(uuid, energy_j)  # (a reload detected here forgets every GPU's track)
        track = self._energy_tracks.get(uuid)
        cycle_s = self._energy_read_s
        if track is None:
            slot = self._energy_slots.setdefault(uuid, len(self._energy_slots))
            offset = (slot * 0.6180339887498949) % 1.0  # spread over the cycle, whatever the number of GPUs
            self._energy_tracks[uuid] = _EnergyTrack(energy_j, now, power_w, now + cycle_s * (1.0 + offset))
            return energy_j, 0.0
        if track.reread(energy_j, now, power_w, now + cycle_s - min(_ENERGY_READ_SLACK_S, cycle_s / 2)):
            clamps = self.energy_clamps[uuid] = self.energy_clamps.get(uuid, 0) + 1
            if clamps % 100 == 1:
                log.warning(
                    "GPU %s: energy counter read %.3f J, below the %.3f J derived from power since the previous "
                    "read: held there (%d times)",
                    uuid,
                    energy_j,
                    track.value_j,
                    clamps,
                )
        return track.value_j, 0.0

    def _read_energy(self, h: Any, uuid: str, now: float) -> float:
        """The driver's energy counter (J): field 191 (r535+, in a call of its own), else
        ``nvmlDeviceGetTotalEnergyConsumption``; each source remembered as absent for the NVML session when it does
        not answer. UnsupportedError when neither does."""
        memo = self._unsupported.setdefault(uuid, {})
        retry_at = memo.get(_ENERGY_FIELD_KEY)
        if retry_at is None or now >= retry_at:
            (item,) = self._nv("nvmlDeviceGetFieldValues", h, [_FI_ENERGY], uuid=uuid, value=[_FI_ENERGY])
            status = int(item.nvmlReturn)
            if status == 0:
                memo.pop(_ENERGY_FIELD_KEY, None)
                return _field_number(item) / 1000.0
            if status == _GPU_IS_LOST:
                raise self._translate(self._nvml_error(status), "nvmlDeviceGetFieldValues", uuid, _FI_ENERGY, "")
            if status not in _FIELD_ABSENT:
                raise PermanentError(f"GPU {uuid}: nvmlDeviceGetFieldValues field {_FI_ENERGY}: NVML error {status}")
            memo[_ENERGY_FIELD_KEY] = now + self._unsupported_retry_s
        retry_at = memo.get(_ENERGY_CALL_KEY)
        if retry_at is not None and now < retry_at:
            raise UnsupportedError(f"GPU {uuid}: no energy counter (field {_FI_ENERGY} and the call)")
        try:
            energy_mj = self._nv("nvmlDeviceGetTotalEnergyConsumption", h, uuid=uuid)
        except UnsupportedError:
            memo[_ENERGY_CALL_KEY] = now + self._unsupported_retry_s
            raise
        memo.pop(_ENERGY_CALL_KEY, None)
        return int(energy_mj) / 1000.0

    def _check_energy(self, uuid: str, energy_j: float) -> None:
        last = self._energy_j.get(uuid)
        self._energy_j[uuid] = energy_j
        if last is not None and energy_j < last - _ENERGY_BACKWARDS_J:
            self._report_reload(f"energy counter of GPU {uuid} went backwards ({last:.0f} J -> {energy_j:.0f} J)")
            self._energy_j[uuid] = energy_j

    def _r_locked_gpu(self, h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
        lo, hi = self._locked_gpu.get(uuid, (0, 0))
        out["locked_gpu_clock_min"] = lo
        out["locked_gpu_clock_max"] = hi

    def _r_locked_memory(self, h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
        if "locked_memory_clock_min" in self._unsupported_writes.get(uuid, ()):
            raise UnsupportedError(f"GPU {uuid}: memory clocks cannot be locked")
        lo, hi = self._locked_memory.get(uuid, (0, 0))
        out["locked_memory_clock_min"] = lo
        out["locked_memory_clock_max"] = hi

    def _r_xid(self, h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
        out["xid_last"] = self._xid_last.get(uuid, 0)

    # ==============================================================================================
    # Processes (their own cycle; docs/processes.md)
    # ==============================================================================================
    def _processes(self, uuid: str) -> ProcessSample:
        h = self._handle(uuid)
        now = self._clock.monotonic()
        unsupported: dict[str, str] = {}
        memory: dict[int, int | None] = {}
        kinds: dict[int, set[str]] = {}
        listed = False
        for kind in ("compute", "graphics"):
            try:
                entries = self._process_list(h, uuid, kind, now)
            except UnsupportedError as exc:
                unsupported[f"processes:{kind}"] = exc.reason
                continue
            listed = True
            seen: dict[int, int | None] = {}
            for entry in entries:
                pid = int(entry.pid)
                used = getattr(entry, "usedGpuMemory", None)
                # MIG: one entry per (GPU instance, compute instance) of a pid, summed; a pid in both lists
                # is one process whose memory NVML reports in each: the larger, not the sum.
                if used is not None:
                    seen[pid] = (seen.get(pid) or 0) + int(used)
                else:
                    seen.setdefault(pid, None)
                kinds.setdefault(pid, set()).add(kind)
            for pid, used in seen.items():
                old = memory.get(pid)
                memory[pid] = used if old is None else (old if used is None else max(old, used))
        if not listed:
            unsupported.setdefault("processes", "not-supported")
        utilization, source = self._process_utilization(h, uuid, now, unsupported)
        energy_j = power_w = None
        try:
            power_w = self._probe(
                uuid,
                "processes:power",
                now,
                unsupported,
                "power",
                lambda: int(self._nv("nvmlDeviceGetPowerUsage", h, uuid=uuid)) / 1000.0,
            )
        except NotFoundError:
            raise
        except PermanentError as exc:
            unsupported["power"] = exc.reason
        try:
            # The collect samples' counter (read from the driver every energy_read_s, derived from power in
            # between), not a read of its own: the driver's counter costs ~4 ms of CPU a read.
            energy_j = self._probe(
                uuid,
                "processes:energy",
                now,
                unsupported,
                "energy",
                lambda: self._energy(h, uuid, now, power_w, may_read=False)[0],
            )
        except NotFoundError:
            raise
        except PermanentError as exc:
            unsupported["energy"] = exc.reason
        procs = []
        for pid in sorted(set(memory) | set(utilization)):
            sm, mem, enc, dec = utilization.get(pid, (None, None, None, None))
            kind = "+".join(sorted(kinds.get(pid, {"compute"})))
            procs.append(GpuProcess(pid, kind, memory.get(pid), sm, mem, enc, dec))
        return ProcessSample(
            uuid=uuid,
            ts_ms=self._clock.wall_ms(),
            processes=tuple(procs),
            energy_j=energy_j,
            power_w=power_w,
            utilization_source=source,
            unsupported=unsupported,
        )

    def _probe(
        self, uuid: str, key: str, now: float, unsupported: dict[str, str], name: str, read: Callable[[], T]
    ) -> T | None:
        """One optional read: skipped until its retry time once NotSupported, None then (and ``unsupported``)."""
        memo = self._unsupported.get(uuid)
        retry_at = memo.get(key) if memo else None
        if retry_at is not None and now < retry_at:
            unsupported[name] = "not-supported"
            return None
        try:
            value = read()
        except UnsupportedError as exc:
            self._unsupported.setdefault(uuid, {})[key] = now + self._unsupported_retry_s
            unsupported[name] = exc.reason
            return None
        if memo:
            memo.pop(key, None)
        return value

    def _process_layout_mismatch(self) -> str:
        """Why the binding cannot read this driver's process list, or "". The r535 drivers write a 32-byte
        ``nvmlProcessInfo_t`` (with ``usedGpuCcProtectedMemory``) from the v3 functions, the others 24 bytes; a
        binding built for the other size reads every process after the first as garbage (nvidia-ml-py 12.535
        on newer drivers, older bindings on r535)."""
        struct = getattr(self._nvml, "c_nvmlProcessInfo_v3_t", None) or getattr(self._nvml, "c_nvmlProcessInfo_t", None)
        fields = getattr(struct, "_fields_", None)
        if not fields:
            return ""  # not a ctypes binding (the simulator): nothing to mismatch
        wide = any(f[0] == "usedGpuCcProtectedMemory" for f in fields)
        if "driver" not in self._process_fns:
            self._process_fns["driver"] = _text(self._nv("nvmlSystemGetDriverVersion"))
        driver = self._process_fns["driver"]
        r535 = driver.split(".", 1)[0] == "535"
        if wide == r535:
            return ""
        return (
            f"this nvidia-ml-py reads process lists as {'32' if wide else '24'}-byte entries but driver {driver} "
            f"writes {'32' if r535 else '24'}-byte ones: upgrade nvidia-ml-py to one built for this driver"
        )

    def _process_list(self, h: Any, uuid: str, kind: str, now: float) -> list[Any]:
        """``nvmlDevice<Kind>RunningProcesses_v3``, else ``_v2`` (drivers before r510 or older bindings)."""
        key = f"processes:{kind}"
        mismatch = self._process_layout_mismatch()
        if mismatch:
            raise UnsupportedError(f"{_where(uuid)}{mismatch}", reason="binding-mismatch")
        memo = self._unsupported.get(uuid)
        if memo and (retry_at := memo.get(key)) is not None:
            if now < retry_at:
                raise UnsupportedError(f"{_where(uuid)}{kind} process list not supported")
            del memo[key]
        chosen = self._process_fns.get(kind)
        names = [chosen] if chosen else list(_PROCESS_LIST_CALLS[kind])
        last: UnsupportedError | None = None
        for name in names:
            try:
                result = list(self._nv(name, h, uuid=uuid))
            except _FunctionMissing as exc:
                last = exc
                continue
            except UnsupportedError as exc:
                last = exc
                break
            self._process_fns[kind] = name
            return result
        self._unsupported.setdefault(uuid, {})[key] = now + self._unsupported_retry_s
        raise last if last is not None else UnsupportedError(f"{_where(uuid)}{kind} process list not supported")

    def _process_utilization(
        self, h: Any, uuid: str, now: float, unsupported: dict[str, str]
    ) -> tuple[dict[int, tuple[float | None, float | None, float | None, float | None]], str]:
        """Per-pid (sm, memory, encoder, decoder) ratios over the samples newer than the last seen one:
        ``nvmlDeviceGetProcessesUtilizationInfo`` (r550+) where present, else ``nvmlDeviceGetProcessUtilization``.
        No sample since then (NotFound) is no utilisation, not an error."""
        memo = self._unsupported.get(uuid)
        since = self._util_seen_us.get(uuid, 0)
        for key, name, source in (
            ("processes:util-info", "nvmlDeviceGetProcessesUtilizationInfo", "processes-utilization-info"),
            ("processes:util", "nvmlDeviceGetProcessUtilization", "process-utilization"),
        ):
            if memo and (retry_at := memo.get(key)) is not None and now < retry_at:
                continue
            try:
                samples = list(self._nv(name, h, since, uuid=uuid, value=since))
            except NotFoundError:
                return {}, source
            except UnsupportedError:
                self._unsupported.setdefault(uuid, {})[key] = now + self._unsupported_retry_s
                continue
            sums: dict[int, list[float]] = {}
            newest = since
            for item in samples:
                stamp = int(item.timeStamp)
                if stamp <= since:
                    continue
                newest = max(newest, stamp)
                acc = sums.setdefault(int(item.pid), [0.0, 0.0, 0.0, 0.0, 0.0])
                acc[0] += int(item.smUtil)
                acc[1] += int(item.memUtil)
                acc[2] += int(item.encUtil)
                acc[3] += int(item.decUtil)
                acc[4] += 1
            self._util_seen_us[uuid] = newest
            return {
                pid: (a[0] / a[4] / 100.0, a[1] / a[4] / 100.0, a[2] / a[4] / 100.0, a[3] / a[4] / 100.0)
                for pid, a in sums.items()
            }, source
        unsupported["utilization"] = "not-supported"
        return {}, ""

    # ==============================================================================================
    # Constraints and setters
    # ==============================================================================================
    def _constraints(self, uuid: str) -> Constraints:
        h = self._handle(uuid)
        lo_w = hi_w = default_w = None
        try:
            lo_mw, hi_mw = self._nv("nvmlDeviceGetPowerManagementLimitConstraints", h, uuid=uuid)
            lo_w, hi_w = lo_mw / 1000.0, hi_mw / 1000.0
        except UnsupportedError:
            pass
        try:
            default_w = self._nv("nvmlDeviceGetPowerManagementDefaultLimit", h, uuid=uuid) / 1000.0
        except UnsupportedError:
            pass
        memory: tuple[int, ...] = ()
        graphics: set[int] = set()
        try:
            memory = tuple(
                sorted((int(c) for c in self._nv("nvmlDeviceGetSupportedMemoryClocks", h, uuid=uuid)), reverse=True)
            )
            for mem in memory:
                clocks = self._nv("nvmlDeviceGetSupportedGraphicsClocks", h, mem, uuid=uuid, value=f"{mem} MHz")
                graphics.update(int(c) for c in clocks)
        except UnsupportedError:
            pass
        return Constraints(
            power_limit_min_w=lo_w,
            power_limit_max_w=hi_w,
            power_limit_default_w=default_w,
            memory_clocks_mhz=memory,
            graphics_clocks_mhz=tuple(sorted(graphics, reverse=True)),
            unsupported=frozenset(self._unsupported_writes.get(uuid, ())),
        )

    def _learn_unsupported(self, uuid: str, *props: str) -> None:
        self._unsupported_writes.setdefault(uuid, set()).update(props)

    def _set_power_limit(self, uuid: str, limit_mw: int) -> float:
        h = self._handle(uuid)
        call = "nvmlDeviceSetPowerManagementLimit"
        try:
            self._nv(call, h, limit_mw, uuid=uuid, value=f"{limit_mw} mW")
        except UnsupportedError:
            self._learn_unsupported(uuid, "power_limit")
            raise
        except InvalidValueError as exc:
            raise InvalidValueError(f"{exc}{self._power_range(h, uuid)}", reason=exc.reason) from exc
        got_mw = int(self._nv("nvmlDeviceGetPowerManagementLimit", h, uuid=uuid))
        if abs(got_mw - limit_mw) > _READ_BACK_TOLERANCE_MW:
            raise ReadBackMismatchError(
                f"GPU {uuid}: {call}({limit_mw} mW) reported success but the limit reads back as {got_mw} mW"
            )
        return got_mw / 1000.0

    def _power_range(self, h: Any, uuid: str) -> str:
        try:
            lo_mw, hi_mw = self._nv("nvmlDeviceGetPowerManagementLimitConstraints", h, uuid=uuid)
        except MapperError:
            return ""
        return f"; the GPU accepts {lo_mw / 1000:g}-{hi_mw / 1000:g} W"

    def _set_locked(self, uuid: str, which: Literal["gpu", "memory"], lo: int, hi: int) -> None:
        h = self._handle(uuid)
        call = "nvmlDeviceSetGpuLockedClocks" if which == "gpu" else "nvmlDeviceSetMemoryLockedClocks"
        props = (f"locked_{which}_clock_min", f"locked_{which}_clock_max")
        try:
            self._nv(call, h, lo, hi, uuid=uuid, value=f"{lo} MHz, {hi} MHz", invalid_reason="not-supported-clock")
        except UnsupportedError:
            self._learn_unsupported(uuid, *props)
            raise
        except InvalidValueError as exc:
            raise InvalidValueError(
                f"{exc}: each clock must be one of the GPU's supported {which} clocks (see constraints()) "
                "and min <= max",
                reason=exc.reason,
            ) from exc
        (self._locked_gpu if which == "gpu" else self._locked_memory)[uuid] = (lo, hi)

    def _reset_locked(self, uuid: str, which: Literal["gpu", "memory"]) -> None:
        h = self._handle(uuid)
        call = "nvmlDeviceResetGpuLockedClocks" if which == "gpu" else "nvmlDeviceResetMemoryLockedClocks"
        try:
            self._nv(call, h, uuid=uuid)
        except UnsupportedError:
            self._learn_unsupported(uuid, f"locked_{which}_clock_min", f"locked_{which}_clock_max")
            raise
        (self._locked_gpu if which == "gpu" else self._locked_memory).pop(uuid, None)

    def _write(self, uuid: str, prop: str, call: str, code: int, shown: str) -> None:
        h = self._handle(uuid)
        try:
            self._nv(call, h, code, uuid=uuid, value=shown, invalid_reason="unknown-value")
        except UnsupportedError:
            self._learn_unsupported(uuid, prop)
            raise


# --------------------------------------------------------------------------------------------------
# Readers that are one plain getter each, and the reading plan
# --------------------------------------------------------------------------------------------------

Reader = Callable[[NvmlBackend, Any, str, dict[str, Value], dict[str, str]], None]
#: A reader bound to one backend and its nvml module, as ``_sample`` runs it: ``step(handle, uuid, out, errors)``.
Step = Callable[[Any, str, dict[str, Value], dict[str, str]], None]


class _Getter:
    """A reader that is one plain NVML getter: ``convert(nvml.<call>(handle, *constants))`` is the value of the
    one property in ``props``, or a pair of values for its two properties; ``constants`` name nvml constants.

    Called as a ``Reader`` it looks the function and the constants up on every call and goes through ``_nv``.
    ``bind(backend)`` looks them up once and gives the step ``_sample`` runs: NVML called directly, its errors
    translated by ``_translate`` exactly as ``_nv`` does (same call name, GPU and reason in the message)."""

    __slots__ = ("call", "constants", "convert", "props")

    def __init__(self, props: tuple[str, ...], call: str, convert: Callable[[Any], Any], *constants: str) -> None:
        if len(props) not in (1, 2):
            raise ValueError(f"{call}: a getter reads one or two properties, not {len(props)}")
        self.props = props
        self.call = call
        self.convert = convert
        self.constants = constants

    def __call__(self, backend: NvmlBackend, h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
        nvml = backend._nvml
        value = self.convert(backend._nv(self.call, h, *(getattr(nvml, a) for a in self.constants), uuid=uuid))
        if len(self.props) == 1:
            out[self.props[0]] = value
        else:
            out[self.props[0]], out[self.props[1]] = value

    def bind(self, backend: NvmlBackend) -> Step:
        nvml = backend._nvml
        fn = getattr(nvml, self.call, None)
        try:
            constants = tuple(getattr(nvml, a) for a in self.constants)
        except AttributeError:
            fn = None
        if fn is None:  # not in this binding: the lookup on every call raises what it always raised
            return partial(self, backend)
        call, convert = self.call, self.convert
        nvml_error, translate = backend._nvml_error, backend._translate

        if len(self.props) == 1:
            (prop,) = self.props

            def step(h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
                try:
                    raw = fn(h, *constants)
                except nvml_error as exc:
                    raise translate(exc, call, uuid, None, "out-of-range") from exc
                out[prop] = convert(raw)

            return step

        first, second = self.props

        def step_pair(h: Any, uuid: str, out: dict[str, Value], errors: dict[str, str]) -> None:
            try:
                raw = fn(h, *constants)
            except nvml_error as exc:
                raise translate(exc, call, uuid, None, "out-of-range") from exc
            out[first], out[second] = convert(raw)

        return step_pair


def _simple(prop: str, call: str, convert: Callable[[Any], Value], *args: str) -> _Getter:
    """A reader for ``prop`` = ``convert(nvml.<call>(handle, *constants))``; args name nvml constants."""
    return _Getter((prop,), call, convert, *args)


def _pair(props: tuple[str, str], call: str, convert: Callable[[Any], tuple[Value, Value]]) -> _Getter:
    return _Getter(props, call, convert)


def _bind(reader: Reader, backend: NvmlBackend) -> Step:
    if isinstance(reader, _Getter):
        return reader.bind(backend)
    return partial(reader, backend)


def _mw_to_w(value: Any) -> float:
    return int(value) / 1000.0


def _reasons(value: Any) -> tuple[Value, Value]:
    mask = int(value)
    return mask, clock_event_reasons_text(mask)


def _compute_mode(value: Any) -> Value:
    return COMPUTE_MODE_NAMES.get(int(value), f"mode{int(value)}")


class _SamplePlan:
    """What one sample of a set of wanted properties reads: the ``_GROUPS`` entries it needs, bound to the
    backend, in ``_GROUPS`` order. ``exact``: every value those readers write is wanted (nothing to filter)."""

    __slots__ = ("exact", "steps")

    def __init__(self, steps: tuple[tuple[str, frozenset[str], Step], ...], wanted: frozenset[str]) -> None:
        self.steps = steps
        self.exact = all(props <= wanted for _, props, _ in steps)


class _EnergyTrack:
    """One GPU's energy counter between two reads of the driver's (``NvmlBackend._energy``).

    ``value_j`` is what was given out last. At a read it becomes the driver's counter, exactly; between reads it
    is that read plus the power readings integrated over time (trapezoids between consecutive readings), and it
    never decreases: a read that comes in below what was given out (the power readings ran ahead of the counter)
    leaves it where it is (``reread`` answers True: counted and logged by the backend) and the integral starts
    again from that read, so the value stays flat until the counter has caught up. A counter that restarted (a
    driver reload or a GPU reset, found by the backend) gets a new track instead."""

    __slots__ = ("anchor_j", "integral_j", "next_read_s", "power_s", "power_w", "read_s", "value_j")

    def __init__(self, energy_j: float, now_s: float, power_w: float | None, next_read_s: float) -> None:
        self.anchor_j = energy_j
        self.value_j = energy_j
        self.read_s = now_s
        self.integral_j = 0.0
        self.power_w = power_w
        self.power_s = now_s
        self.next_read_s = next_read_s

    def derive(self, now_s: float, power_w: float) -> float:
        if self.power_w is not None and now_s > self.power_s:
            self.integral_j += (self.power_w + power_w) * 0.5 * (now_s - self.power_s)
        self.power_w, self.power_s = power_w, now_s
        value = self.anchor_j + self.integral_j
        if value > self.value_j:
            self.value_j = value
        return self.value_j

    def reread(self, energy_j: float, now_s: float, power_w: float | None, next_read_s: float) -> bool:
        """A new read of the driver's counter; True when it was below the value given out (which then stays)."""
        clamped = energy_j < self.value_j
        if not clamped:
            self.value_j = energy_j
        self.anchor_j = energy_j
        self.integral_j = 0.0
        self.read_s = now_s
        self.power_w, self.power_s = power_w, now_s
        self.next_read_s = next_read_s
        return clamped


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Memo(Generic[K, V]):
    """At most ``size`` remembered results; when full, the oldest one is forgotten first. A lookup takes no
    lock (one dict read); a store does, because callers on several threads may store at once."""

    __slots__ = ("_known", "_lock", "_size")

    def __init__(self, size: int) -> None:
        self._known: dict[K, V] = {}
        self._lock = threading.Lock()
        self._size = size

    def __len__(self) -> int:
        return len(self._known)

    def get(self, key: K) -> V | None:
        return self._known.get(key)

    def put(self, key: K, value: V) -> V:
        with self._lock:
            known = self._known
            if key not in known and len(known) >= self._size:
                del known[next(iter(known))]
            known[key] = value
        return value


#: Reading groups whose values the board and the driver fix (power limit range and default, temperature
#: thresholds, maximum SM clock): read once per NVML session and per GPU, then served from ``_static``.
_STATIC_GROUPS = frozenset(
    {"temperature_slowdown", "temperature_shutdown", "power_limit_constraints", "power_limit_default", "clock_sm_max"}
)

_GROUPS: tuple[tuple[str, frozenset[str], Reader], ...] = tuple(
    (name, frozenset(props), reader)
    for name, props, reader in (
        ("identity", ("uuid", "product_name"), NvmlBackend._r_identity),
        (
            "utilization",
            ("utilization_gpu", "utilization_memory"),
            _pair(
                ("utilization_gpu", "utilization_memory"),
                "nvmlDeviceGetUtilizationRates",
                lambda v: (int(v.gpu), int(v.memory)),
            ),
        ),
        ("memory", ("memory_used", "memory_total", "memory_reserved"), NvmlBackend._r_memory),
        ("temperature", ("temperature",), NvmlBackend._r_temperature),
        ("temperature_memory", ("temperature_memory",), NvmlBackend._r_memory_temperature),
        (
            "temperature_slowdown",
            ("temperature_slowdown",),
            _simple(
                "temperature_slowdown",
                "nvmlDeviceGetTemperatureThreshold",
                int,
                "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN",
            ),
        ),
        (
            "temperature_shutdown",
            ("temperature_shutdown",),
            _simple(
                "temperature_shutdown",
                "nvmlDeviceGetTemperatureThreshold",
                int,
                "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN",
            ),
        ),
        ("fan_speed", ("fan_speed",), _simple("fan_speed", "nvmlDeviceGetFanSpeed", int)),
        ("power_usage", ("power_usage",), _simple("power_usage", "nvmlDeviceGetPowerUsage", _mw_to_w)),
        # (after power_usage: the energy counter is integrated from the power this sample read)
        ("energy", ("energy_consumption", "energy_consumption_age"), NvmlBackend._r_energy),
        (
            "power_limit_enforced",
            ("power_limit_enforced",),
            _simple("power_limit_enforced", "nvmlDeviceGetEnforcedPowerLimit", _mw_to_w),
        ),
        (
            "power_limit_constraints",
            ("power_limit_min", "power_limit_max"),
            _pair(
                ("power_limit_min", "power_limit_max"),
                "nvmlDeviceGetPowerManagementLimitConstraints",
                lambda v: (_mw_to_w(v[0]), _mw_to_w(v[1])),
            ),
        ),
        (
            "power_limit_default",
            ("power_limit_default",),
            _simple("power_limit_default", "nvmlDeviceGetPowerManagementDefaultLimit", _mw_to_w),
        ),
        ("power_limit", ("power_limit",), _simple("power_limit", "nvmlDeviceGetPowerManagementLimit", _mw_to_w)),
        ("clock_sm", ("clock_sm",), _simple("clock_sm", "nvmlDeviceGetClockInfo", int, "NVML_CLOCK_SM")),
        ("clock_memory", ("clock_memory",), _simple("clock_memory", "nvmlDeviceGetClockInfo", int, "NVML_CLOCK_MEM")),
        (
            "clock_sm_max",
            ("clock_sm_max",),
            _simple("clock_sm_max", "nvmlDeviceGetMaxClockInfo", int, "NVML_CLOCK_SM"),
        ),
        ("clock_event_reasons", ("clock_event_reasons", "clock_event_reasons_text"), NvmlBackend._r_reasons),
        ("pstate", ("pstate",), _simple("pstate", "nvmlDeviceGetPerformanceState", int)),
        (
            "pcie_tx",
            ("pcie_tx",),
            _simple("pcie_tx", "nvmlDeviceGetPcieThroughput", lambda v: int(v) * 1024, "NVML_PCIE_UTIL_TX_BYTES"),
        ),
        (
            "pcie_rx",
            ("pcie_rx",),
            _simple("pcie_rx", "nvmlDeviceGetPcieThroughput", lambda v: int(v) * 1024, "NVML_PCIE_UTIL_RX_BYTES"),
        ),
        (
            "ecc_errors_corrected",
            ("ecc_errors_corrected",),
            _simple(
                "ecc_errors_corrected",
                "nvmlDeviceGetTotalEccErrors",
                int,
                "NVML_MEMORY_ERROR_TYPE_CORRECTED",
                "NVML_VOLATILE_ECC",
            ),
        ),
        (
            "ecc_errors_uncorrected",
            ("ecc_errors_uncorrected",),
            _simple(
                "ecc_errors_uncorrected",
                "nvmlDeviceGetTotalEccErrors",
                int,
                "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
                "NVML_VOLATILE_ECC",
            ),
        ),
        (
            "remapped_rows",
            ("remapped_rows_uncorrectable", "remapped_rows_pending"),
            _pair(
                ("remapped_rows_uncorrectable", "remapped_rows_pending"),
                "nvmlDeviceGetRemappedRows",
                lambda v: (int(v[1]), bool(v[2])),
            ),
        ),
        ("xid_last", ("xid_last",), NvmlBackend._r_xid),
        ("locked_gpu_clocks", ("locked_gpu_clock_min", "locked_gpu_clock_max"), NvmlBackend._r_locked_gpu),
        (
            "locked_memory_clocks",
            ("locked_memory_clock_min", "locked_memory_clock_max"),
            NvmlBackend._r_locked_memory,
        ),
        (
            "persistence_mode",
            ("persistence_mode",),
            _simple("persistence_mode", "nvmlDeviceGetPersistenceMode", lambda v: int(v) == 1),
        ),
        ("compute_mode", ("compute_mode",), _simple("compute_mode", "nvmlDeviceGetComputeMode", _compute_mode)),
    )
)

#: The getters of the blocking groups, run on their own thread (``NvmlBackend._start_blocking``).
_BLOCKING_GETTERS: Mapping[str, _Getter] = MappingProxyType(
    {name: reader for name, _, reader in _GROUPS if name in _BLOCKING_GROUPS and isinstance(reader, _Getter)}
)
assert set(_BLOCKING_GETTERS) == _BLOCKING_GROUPS


class _BlockingState:
    """One GPU's blocking read of one group: when it was last asked for and how far apart its asks are (at first
    the catalog's collect cycle), whether a read runs and when the last one was started, and the last outcome
    ((True, raw value) or (False, the exception)) with the time its read was started."""

    __slots__ = ("asked_s", "done", "outcome", "outcome_s", "period_s", "running", "started_s")

    def __init__(self, period_s: float) -> None:
        self.asked_s = -math.inf
        self.period_s = period_s
        self.running = False
        self.started_s = -math.inf
        self.outcome: tuple[bool, Any] | None = None
        self.outcome_s = -math.inf
        #: Set when a read has finished (the first ask waits for it).
        self.done = threading.Event()


#: What the interval between a blocking group's asks is taken to be before there were two: its property's
#: catalog collect cycle.
_BLOCKING_PERIOD_GUESS_S: Mapping[str, float] = MappingProxyType(
    {group: PROPERTY_BY_NAME[g.props[0]].collect_cycle_ms / 1000.0 for group, g in _BLOCKING_GETTERS.items()}
)


_ALL_NVML = frozenset(p.name for p in NVML_PROPERTIES)


def _wanted(properties: Iterable[str] | None) -> frozenset[str]:
    """The NVML properties to read; mapper-computed ones are skipped, unknown names are an error."""
    if properties is None:
        return _ALL_NVML
    if isinstance(properties, str):
        properties = (properties,)
    names = set()
    for name in properties:
        spec = PROPERTY_BY_NAME.get(name)
        if spec is None:
            raise InvalidValueError(
                f"sample: unknown property {name!r} (not in the GPU catalog)", reason="unknown-property"
            )
        if spec.source == "nvml":
            names.add(name)
    return frozenset(names)


# --------------------------------------------------------------------------------------------------
# The worker thread every NVML call runs on
# --------------------------------------------------------------------------------------------------

_QUEUED, _RUNNING, _FINISHED, _CANCELLED = range(4)


class _Planned(BaseException):
    """Raised by ``_call`` while ``call_async`` plans a public method: the job to run instead of running it.
    A BaseException so that no ``except Exception`` in a public method can swallow it."""

    def __init__(self, what: str, fn: Callable[[], Any], needs_session: bool | None) -> None:
        super().__init__(what)
        self.what = what
        self.fn = fn
        self.needs_session = needs_session
        #: Set by the awaiting caller when it is cancelled; the worker then skips the call if not started.
        self.cancelled = False


class _Job:
    __slots__ = ("done", "error", "fn", "on_done", "result", "state")

    def __init__(self, fn: Callable[[], Any], on_done: Callable[[], None] | None = None) -> None:
        self.fn = fn
        #: Called on the worker thread once the job has finished (after ``done`` is released); must not raise.
        self.on_done = on_done
        self.result: Any = None
        self.error: BaseException | None = None
        self.state = _QUEUED
        self.done = threading.Lock()
        self.done.acquire()

    @property
    def finished(self) -> bool:
        return self.state == _FINISHED

    def wait(self, timeout_s: float) -> bool:
        return self.done.acquire(timeout=timeout_s)


class _Worker:
    """One daemon thread running jobs in order. A daemon, so a call hung inside NVML never blocks process exit;
    a plain lock per job as the reply latch (cheaper than a Future's condition variable)."""

    def __init__(self, name: str = "nvml") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], on_done: Callable[[], None] | None = None) -> _Job:
        job = _Job(fn, on_done)
        self._jobs.put(job)
        return job

    def cancel(self, job: _Job) -> bool:
        """Cancel a job that has not started; False when it is running or done."""
        with self._lock:
            if job.state == _QUEUED:
                job.state = _CANCELLED
                return True
            return False

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                if job.state == _CANCELLED:
                    continue
                job.state = _RUNNING
            try:
                job.result = job.fn()
            except BaseException as exc:
                job.error = exc
            job.state = _FINISHED
            job.done.release()
            if job.on_done is not None:
                try:
                    job.on_done()
                except Exception:  # a waiter's callback must never stop the worker
                    pass


# --------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------


def _handle_key(handle: Any) -> int:
    """A device handle's identity: the address a pynvml pointer holds (event data carries a new pointer object
    with the same address), or the object itself for the simulator's handles."""
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


def _where(uuid: str) -> str:
    return f"GPU {uuid}: " if uuid else "NVML: "


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


#: ``nvmlValue_t`` member and conversion by ``nvmlValueType_t`` (pynvml.NVML_VALUE_TYPE_*).
_FIELD_VALUE_MEMBERS: Mapping[int, tuple[str, Callable[[Any], float]]] = MappingProxyType(
    {
        0: ("dVal", float),
        1: ("uiVal", int),
        2: ("ulVal", int),
        3: ("ullVal", int),
        4: ("sllVal", int),
        5: ("siVal", int),
        6: ("usVal", int),
    }
)


def _field_number(item: Any) -> float:
    """The value of one ``nvmlDeviceGetFieldValues`` item by its value type (unknown types: unsigned long long).
    nvidia-ml-py before 12.550 has no ``usVal`` in ``c_nvmlValue_t``: an unsigned short is then the low 16 bits
    of ``uiVal`` (the union's first bytes; NVML hosts are little-endian)."""
    member, convert = _FIELD_VALUE_MEMBERS.get(int(item.valueType), ("ullVal", int))
    value = item.value
    if member == "usVal" and not hasattr(value, "usVal"):
        return int(value.uiVal) & 0xFFFF
    return convert(getattr(value, member))


def _number(prop: str, value: object) -> float:
    """A finite, non-negative number, or InvalidValueError naming what is wrong."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        if isinstance(value, str):
            raise InvalidValueError(f"{prop}: {value!r} is a string, not a number", reason="not-a-number")
        raise InvalidValueError(f"{prop}: {value!r} is not a number", reason="wrong-type")
    return check_number(prop, float(value))


def _clock_pair(prop: str, min_mhz: object, max_mhz: object) -> tuple[int, int]:
    values = []
    for suffix, raw in (("min", min_mhz), ("max", max_mhz)):
        number = _number(f"{prop}_{suffix}", raw)
        if number != int(number):
            raise InvalidValueError(f"{prop}_{suffix}: {number:g} MHz is not a whole number", reason="wrong-type")
        values.append(int(number))
    lo, hi = values
    if lo > hi:
        raise InvalidValueError(f"{prop}: min {lo} MHz is above max {hi} MHz", reason="out-of-range")
    if (lo == 0) != (hi == 0):
        raise InvalidValueError(
            f"{prop}: {lo}/{hi} MHz: 0 (unlock) must be given for both or neither", reason="unpaired"
        )
    return lo, hi
