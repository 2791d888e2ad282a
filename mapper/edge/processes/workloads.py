"""Which container and pod a GPU process belongs to, from ``/proc/<pid>/cgroup``. Reads files only.

NVML reports host PIDs (the driver does not see PID namespaces). For each one this module reads
``<proc_root>/<pid>/cgroup`` and finds the container runtime, the container id, the pod UID and the pod's QoS
class in the cgroup path. The forms it knows (cgroup v1 and v2; systemd and cgroupfs drivers):

=================  =================================================================================
systemd driver     ``/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_>.slice/<rt>-<id>.scope``
                   (Guaranteed pods have no ``<qos>`` level; the UID's dashes are underscores; ``<rt>`` is
                   ``cri-containerd``, ``crio`` or ``docker``)
cgroupfs driver    ``/kubepods/<qos>/pod<uid>/<id>`` (containerd, Docker) or ``.../pod<uid>/crio-<id>``
plain Docker       ``/docker/<id>`` (cgroupfs) and ``/system.slice/docker-<id>.scope`` (systemd)
=================  =================================================================================

A path may carry leading ``/..`` segments (a private cgroup namespace) or a sub-cgroup below the container's;
both are tolerated. On cgroup v1 the line of the ``memory``, ``cpu``, ``pids`` or ``name=systemd`` hierarchy
that names a container is used; on v2 the single ``0::`` line.

Pod names and namespaces come from the files the kubelet (or KubeEdge's edged, which embeds the kubelet's pod
code) leaves on the host, read under a configurable root (``PodDirs``), in this order:

1. ``/var/log/containers/<pod>_<namespace>_<container>-<id>.log``: pod, namespace and container name by
   container id (the kubelet's log links; ``_`` cannot occur in any of the three names).
2. ``/var/log/pods/<namespace>_<pod>_<uid>/``: pod and namespace by pod UID.
3. ``/var/lib/kubelet/pods/<uid>/`` or ``/var/lib/edged/pods/<uid>/``: the namespace from a projected
   service-account volume's ``namespace`` file and the pod's host name from ``etc-hosts`` (the pod name unless
   the pod sets ``spec.hostname``). Token files are never read.

Where none is readable the pod is named by its UID alone, with the reason. Where ``/proc/<pid>`` is not
visible (no ``hostPID: true``) the process is reported by pid alone, with the reason.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "ContainerRef",
    "PodDirs",
    "PodInfo",
    "PodResolver",
    "ProcessOwner",
    "parse_cgroup",
    "parse_cgroup_path",
    "read_owner",
]

Runtime = Literal["containerd", "cri-o", "docker", ""]
Qos = Literal["guaranteed", "burstable", "besteffort", ""]

_ID = r"[0-9a-f]{64}"
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_SCOPE_RE = re.compile(rf"^(cri-containerd|crio|docker)-({_ID})\.scope$")
_CRIO_CGROUPFS_RE = re.compile(rf"^crio-({_ID})$")
_BARE_ID_RE = re.compile(rf"^({_ID})$")
_POD_SYSTEMD_RE = re.compile(rf"^kubepods(?:-(burstable|besteffort))?-pod({_UID})\.slice$")
_POD_CGROUPFS_RE = re.compile(rf"^pod({_UID})$")
_QOS_SYSTEMD_RE = re.compile(r"^kubepods-(burstable|besteffort)\.slice$")
_V1_PREFERRED = ("memory", "cpu", "cpu,cpuacct", "cpuacct,cpu", "pids", "name=systemd")
_RUNTIME_BY_PREFIX: Mapping[str, Runtime] = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"}


@dataclass(frozen=True)
class ContainerRef:
    """Where a process's cgroup puts it. Empty strings where the path does not say."""

    container_id: str = ""
    runtime: Runtime = ""
    pod_uid: str = ""
    qos: Qos = ""

    @property
    def in_pod(self) -> bool:
        return bool(self.pod_uid)


def _norm_uid(raw: str) -> str:
    return raw.replace("_", "-")


def parse_cgroup_path(path: str) -> ContainerRef | None:
    """The container and pod a cgroup path names, or None when it names neither (a host process)."""
    segments = [s for s in path.split("/") if s and s != ".."]
    container_id = ""
    runtime: Runtime = ""
    pod_uid = ""
    qos: Qos = ""
    kubepods = False
    for index, seg in enumerate(segments):
        if seg in ("kubepods", "kubepods.slice"):
            kubepods = True
            # cgroupfs: /kubepods/<qos>/pod<uid>; Guaranteed: /kubepods/pod<uid>
            continue
        if m := _QOS_SYSTEMD_RE.match(seg):
            qos = "burstable" if m.group(1) == "burstable" else "besteffort"
            continue
        if m := _POD_SYSTEMD_RE.match(seg):
            pod_uid = _norm_uid(m.group(2))
            if m.group(1):
                qos = "burstable" if m.group(1) == "burstable" else "besteffort"
            continue
        if kubepods and seg in ("burstable", "besteffort") and not pod_uid:
            qos = "burstable" if seg == "burstable" else "besteffort"
            continue
        if m := _POD_CGROUPFS_RE.match(seg):
            pod_uid = _norm_uid(m.group(1))
            continue
        if not container_id:
            if m := _SCOPE_RE.match(seg):
                container_id, runtime = m.group(2), _RUNTIME_BY_PREFIX[m.group(1)]
                continue
            if m := _CRIO_CGROUPFS_RE.match(seg):
                container_id, runtime = m.group(1), "cri-o"
                continue
            if m := _BARE_ID_RE.match(seg):
                container_id = m.group(1)
                previous = segments[index - 1] if index else ""
                # cgroupfs Docker outside Kubernetes: /docker/<id>. Under a pod the bare id is containerd's or
                # Docker's (cri-dockerd); the path does not tell which.
                runtime = "docker" if previous == "docker" else ("containerd" if pod_uid else "")
                continue
    if pod_uid and not qos:
        qos = "guaranteed"
    if not container_id and not pod_uid:
        return None
    return ContainerRef(container_id=container_id, runtime=runtime, pod_uid=pod_uid, qos=qos)


def parse_cgroup(text: str) -> ContainerRef | None:
    """The container and pod named by the text of a ``/proc/<pid>/cgroup`` file (cgroup v1, v2 or hybrid)."""
    v2: ContainerRef | None = None
    v1: dict[str, ContainerRef] = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _hier, controllers, path = parts
        ref = parse_cgroup_path(path)
        if ref is None:
            continue
        if controllers == "":
            v2 = ref
        else:
            v1.setdefault(controllers, ref)
    for name in _V1_PREFERRED:
        if name in v1:
            return v1[name]
    if v1:
        # Any other v1 hierarchy that names a container (prefer one with both a pod and a container).
        return max(v1.values(), key=lambda r: (bool(r.pod_uid), bool(r.container_id)))
    return v2


@dataclass(frozen=True)
class PodInfo:
    uid: str
    namespace: str = ""
    name: str = ""
    #: Where name and namespace came from: ``log-links``, ``log-pods``, ``pod-dir`` or "" (not found).
    source: str = ""


@dataclass(frozen=True)
class ProcessOwner:
    """A GPU process and what it belongs to, as far as this host lets us see."""

    pid: int
    comm: str = ""
    container: ContainerRef | None = None
    pod: PodInfo | None = None
    container_name: str = ""
    #: Why the pod (or the process itself) could not be named; "" when it was.
    reason: str = ""

    @property
    def namespace(self) -> str:
        return self.pod.namespace if self.pod else ""

    @property
    def pod_name(self) -> str:
        """The pod's name, else its UID, else ""."""
        if self.pod is None:
            return ""
        return self.pod.name or self.pod.uid


def read_owner(proc_root: str, pid: int) -> tuple[str, ContainerRef | None, str]:
    """``(comm, container, reason)`` for one pid from ``<proc_root>/<pid>``; reason "" when it was readable."""
    base = os.path.join(proc_root, str(pid))
    try:
        with open(os.path.join(base, "cgroup"), encoding="utf-8", errors="replace") as fh:
            text = fh.read(65536)
    except FileNotFoundError:
        return "", None, f"pid {pid} not visible under {proc_root} (the mapper needs hostPID: true)"
    except OSError as exc:
        return "", None, f"cannot read {base}/cgroup: {exc.strerror or exc}"
    comm = ""
    try:
        with open(os.path.join(base, "comm"), encoding="utf-8", errors="replace") as fh:
            comm = fh.read(64).strip()
    except OSError:
        comm = ""
    return comm, parse_cgroup(text), ""


@dataclass(frozen=True)
class PodDirs:
    """Where the kubelet's (or edged's) files are, as seen by the mapper (a host path mounted in)."""

    log_containers: str = "/var/log/containers"
    log_pods: str = "/var/log/pods"
    pod_dirs: tuple[str, ...] = ("/var/lib/kubelet/pods", "/var/lib/edged/pods")

    @classmethod
    def under(cls, root: str) -> PodDirs:
        """The same layout below ``root`` (a fixture tree, or a host root mounted at ``/host``)."""
        default = cls()
        return cls(
            log_containers=os.path.join(root, default.log_containers.lstrip("/")),
            log_pods=os.path.join(root, default.log_pods.lstrip("/")),
            pod_dirs=tuple(os.path.join(root, p.lstrip("/")) for p in default.pod_dirs),
        )


_LOG_LINK_RE = re.compile(rf"^([^_]+)_([^_]+)_(.+)-({_ID})\.log$")
_LOG_POD_RE = re.compile(rf"^([^_]+)_([^_]+)_({_UID})$")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


@dataclass
class PodResolver:
    """Names pods and containers from the kubelet's files. ``refresh()`` rescans (call it on the process
    cycle when an unknown container or pod turns up, not for every process); lookups are dict reads."""

    dirs: PodDirs = field(default_factory=PodDirs)
    _by_container: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    _by_uid: dict[str, PodInfo] = field(default_factory=dict)
    #: Why nothing could be named ("" once any source was readable).
    unreadable_reason: str = ""
    _parsed: dict[str, dict[int, tuple[str, ContainerRef | None, str]]] = field(default_factory=dict)

    def refresh(self) -> None:
        by_container: dict[str, tuple[str, str, str]] = {}
        by_uid: dict[str, PodInfo] = {}
        readable = False
        if os.path.isdir(self.dirs.log_containers):
            readable = True
            for name in _listdir(self.dirs.log_containers):
                if m := _LOG_LINK_RE.match(name):
                    by_container[m.group(4)] = (m.group(2), m.group(1), m.group(3))
        if os.path.isdir(self.dirs.log_pods):
            readable = True
            for name in _listdir(self.dirs.log_pods):
                if m := _LOG_POD_RE.match(name):
                    uid = _norm_uid(m.group(3))
                    by_uid[uid] = PodInfo(uid=uid, namespace=m.group(1), name=m.group(2), source="log-pods")
        for pod_root in self.dirs.pod_dirs:
            if not os.path.isdir(pod_root):
                continue
            readable = True
            for uid in _listdir(pod_root):
                if uid in by_uid or not re.fullmatch(_UID, uid):
                    continue
                by_uid[uid] = _from_pod_dir(os.path.join(pod_root, uid), uid)
        self._by_container = by_container
        self._by_uid = by_uid
        self.unreadable_reason = (
            ""
            if readable
            else (
                f"none of {self.dirs.log_containers}, {self.dirs.log_pods}, {', '.join(self.dirs.pod_dirs)} "
                "is readable (mount them read-only to name pods)"
            )
        )

    def knows(self, ref: ContainerRef) -> bool:
        return (bool(ref.container_id) and ref.container_id in self._by_container) or ref.pod_uid in self._by_uid

    def resolve(self, pid: int, comm: str, ref: ContainerRef | None, reason: str = "") -> ProcessOwner:
        """The owner of one process from its parsed cgroup (``reason`` from ``read_owner`` if it failed)."""
        if ref is None:
            return ProcessOwner(pid=pid, comm=comm, reason=reason or ("host process" if comm else ""))
        if not ref.pod_uid:
            return ProcessOwner(pid=pid, comm=comm, container=ref, reason="container outside Kubernetes")
        linked = self._by_container.get(ref.container_id) if ref.container_id else None
        pod = self._by_uid.get(ref.pod_uid)
        if linked is not None:
            namespace, name, container_name = linked
            info = PodInfo(uid=ref.pod_uid, namespace=namespace, name=name, source="log-links")
            return ProcessOwner(pid=pid, comm=comm, container=ref, pod=info, container_name=container_name)
        if pod is not None and (pod.name or pod.namespace):
            return ProcessOwner(pid=pid, comm=comm, container=ref, pod=pod)
        why = self.unreadable_reason or f"pod {ref.pod_uid} not found in the kubelet's or edged's files"
        return ProcessOwner(pid=pid, comm=comm, container=ref, pod=PodInfo(uid=ref.pod_uid), reason=why)

    def cached(self, pids: Iterable[int], scope: str = "") -> bool:
        """Whether ``owners(..., pids, scope)`` would read no file: every pid's cgroup is known and so is its pod
        (then it may run on the event loop; otherwise it belongs in a thread)."""
        cache = self._parsed.get(scope, {})
        for pid in pids:
            got = cache.get(pid)
            if got is None:
                return False
            ref = got[1]
            if ref is not None and ref.pod_uid and not self.knows(ref):
                return False
        return True

    def owners(self, proc_root: str, pids: Iterable[int], scope: str = "") -> dict[int, ProcessOwner]:
        """Every pid's owner; rescans the kubelet's files once if a pod turns up that they did not name.

        A pid's cgroup is read once while it stays in the lists handed in for ``scope`` (a GPU's UUID; a process
        does not change pods); a pid absent from one call is forgotten, so a reused pid is read afresh unless it
        came back within one process cycle."""
        cache = self._parsed.get(scope, {})
        parsed = {pid: cache.get(pid) or read_owner(proc_root, pid) for pid in pids}
        # (A pid that could not be read is kept too: without hostPID it stays invisible while it runs.)
        self._parsed[scope] = parsed
        if any(ref is not None and ref.pod_uid and not self.knows(ref) for _c, ref, _r in parsed.values()):
            self.refresh()
        return {pid: self.resolve(pid, comm, ref, reason) for pid, (comm, ref, reason) in parsed.items()}


def _read_small(path: str, limit: int = 4096) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(limit)
    except OSError:
        return ""


def _from_pod_dir(path: str, uid: str) -> PodInfo:
    namespace = ""
    projected = os.path.join(path, "volumes", "kubernetes.io~projected")
    for volume in sorted(_listdir(projected)):
        text = _read_small(os.path.join(projected, volume, "namespace"), 256).strip()
        if text:
            namespace = text
            break
    name = ""
    for line in _read_small(os.path.join(path, "etc-hosts")).splitlines():
        fields = line.split("#", 1)[0].split()
        # After the localhost lines the kubelet writes "<pod IP>\t<hostname>[.<subdomain>...]", then any
        # hostAliases: the first other line is the pod's own.
        if len(fields) >= 2 and not fields[1].startswith(("localhost", "ip6-")):
            name = fields[1].split(".", 1)[0]
            break
    return PodInfo(uid=uid, namespace=namespace, name=name, source="pod-dir" if (namespace or name) else "")
