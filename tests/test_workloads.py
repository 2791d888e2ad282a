"""Process -> container -> pod from /proc/<pid>/cgroup over fixture trees (every runtime and driver form)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mapper.edge.processes.workloads import (
    ContainerRef,
    PodDirs,
    PodResolver,
    parse_cgroup,
    parse_cgroup_path,
    read_owner,
)

CID = "3f4c1b2a" * 8  # 64 hex
CID2 = "a1b2c3d4" * 8
UID = "1c2d3e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f"
UID_ = UID.replace("-", "_")

# (description, /proc/<pid>/cgroup text, expected ref)
CASES: list[tuple[str, str, ContainerRef | None]] = [
    (
        "v2 systemd containerd burstable",
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        ContainerRef(CID, "containerd", UID, "burstable"),
    ),
    (
        "v2 systemd containerd besteffort",
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        ContainerRef(CID, "containerd", UID, "besteffort"),
    ),
    (
        "v2 systemd containerd guaranteed",
        f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        ContainerRef(CID, "containerd", UID, "guaranteed"),
    ),
    (
        "v2 systemd cri-o burstable",
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-{CID}.scope\n",
        ContainerRef(CID, "cri-o", UID, "burstable"),
    ),
    (
        "v2 systemd docker (cri-dockerd) guaranteed",
        f"0::/kubepods.slice/kubepods-pod{UID_}.slice/docker-{CID}.scope\n",
        ContainerRef(CID, "docker", UID, "guaranteed"),
    ),
    (
        "v2 cgroupfs containerd besteffort",
        f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
        ContainerRef(CID, "containerd", UID, "besteffort"),
    ),
    (
        "v2 cgroupfs containerd guaranteed",
        f"0::/kubepods/pod{UID}/{CID}\n",
        ContainerRef(CID, "containerd", UID, "guaranteed"),
    ),
    (
        "v2 cgroupfs cri-o burstable",
        f"0::/kubepods/burstable/pod{UID}/crio-{CID}\n",
        ContainerRef(CID, "cri-o", UID, "burstable"),
    ),
    (
        "v1 cgroupfs bare id (containerd, or Docker via dockershim: the path does not tell)",
        f"12:pids:/kubepods/burstable/pod{UID}/{CID}\n11:memory:/kubepods/burstable/pod{UID}/{CID}\n"
        f"4:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}\n1:name=systemd:/kubepods/burstable/pod{UID}/{CID}\n",
        ContainerRef(CID, "containerd", UID, "burstable"),
    ),
    (
        "v1 systemd containerd (hybrid, 0:: line is /)",
        f"12:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n"
        f"1:name=systemd:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n"
        "0::/\n",
        ContainerRef(CID, "containerd", UID, "burstable"),
    ),
    (
        "v1 systemd cri-o besteffort",
        f"9:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope\n",
        ContainerRef(CID, "cri-o", UID, "besteffort"),
    ),
    ("plain docker cgroupfs", f"0::/docker/{CID}\n", ContainerRef(CID, "docker", "", "")),
    ("plain docker systemd", f"0::/system.slice/docker-{CID}.scope\n", ContainerRef(CID, "docker", "", "")),
    (
        "private cgroup namespace (leading /..) and a sub-cgroup",
        f"0::/../../kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope/init\n",
        ContainerRef(CID, "containerd", UID, "burstable"),
    ),
    ("host process, systemd service", "0::/system.slice/ollama.service\n", None),
    ("host process, user session", "0::/user.slice/user-1000.slice/session-3.scope\n", None),
    ("garbage", "not a cgroup file\n::\n", None),
]


@pytest.mark.parametrize(("text", "expected"), [(t, e) for _d, t, e in CASES], ids=[d for d, _t, _e in CASES])
def test_cgroup_forms(text: str, expected: ContainerRef | None) -> None:
    assert parse_cgroup(text) == expected


def test_a_crio_conmon_scope_is_not_the_container() -> None:
    ref = parse_cgroup_path(f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{CID}.scope")
    assert ref == ContainerRef("", "", UID, "guaranteed")


def _proc(root: Path, pid: int, cgroup: str, comm: str = "python3") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    (d / "comm").write_text(comm + "\n")


def _host(tmp_path: Path) -> tuple[Path, PodDirs]:
    host = tmp_path / "host"
    return host, PodDirs.under(str(host))


def test_names_from_the_kubelets_log_links(tmp_path: Path) -> None:
    _host_root, dirs = _host(tmp_path)
    proc = tmp_path / "proc"
    _proc(proc, 4242, CASES[0][1])
    links = Path(dirs.log_containers)
    links.mkdir(parents=True)
    (links / f"trainer-7d9f_ml-team_pytorch-{CID}.log").symlink_to("/nonexistent")
    (links / f"other_kube-system_x-{CID2}.log").write_text("")
    owners = PodResolver(dirs).owners(str(proc), [4242])
    owner = owners[4242]
    assert owner.comm == "python3"
    assert (owner.namespace, owner.pod_name, owner.container_name) == ("ml-team", "trainer-7d9f", "pytorch")
    assert owner.pod is not None and owner.pod.uid == UID and owner.pod.source == "log-links"
    assert owner.reason == ""


def test_names_from_log_pods_by_uid(tmp_path: Path) -> None:
    _host_root, dirs = _host(tmp_path)
    proc = tmp_path / "proc"
    _proc(proc, 7, CASES[5][1])
    Path(dirs.log_pods, f"vision_detector-0_{UID}").mkdir(parents=True)
    owner = PodResolver(dirs).owners(str(proc), [7])[7]
    assert (owner.namespace, owner.pod_name) == ("vision", "detector-0")
    assert owner.pod is not None and owner.pod.source == "log-pods"


@pytest.mark.parametrize("pods_dir", ["var/lib/kubelet/pods", "var/lib/edged/pods"])
def test_names_from_kubelet_or_edged_pod_dirs(tmp_path: Path, pods_dir: str) -> None:
    host, dirs = _host(tmp_path)
    proc = tmp_path / "proc"
    _proc(proc, 9, CASES[7][1])
    pod = host / pods_dir / UID
    vol = pod / "volumes" / "kubernetes.io~projected" / "kube-api-access-x7k2p"
    vol.mkdir(parents=True)
    (vol / "namespace").write_text("edge-apps")
    (vol / "token").write_text("SECRET-never-read")
    (pod / "etc-hosts").write_text(
        "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
        "fe00::0\tip6-localnet\n10.244.1.17\tinfer-5c8d\n\n# Entries added by HostAliases.\n10.0.0.1\tregistry\n"
    )
    owner = PodResolver(dirs).owners(str(proc), [9])[9]
    assert (owner.namespace, owner.pod_name) == ("edge-apps", "infer-5c8d")
    assert owner.pod is not None and owner.pod.source == "pod-dir"


def test_pod_uid_alone_with_a_reason_when_nothing_is_readable(tmp_path: Path) -> None:
    _host_root, dirs = _host(tmp_path)
    proc = tmp_path / "proc"
    _proc(proc, 11, CASES[0][1])
    owner = PodResolver(dirs).owners(str(proc), [11])[11]
    assert owner.pod_name == UID and owner.namespace == ""
    assert "readable" in owner.reason and "mount" in owner.reason


def test_without_host_pid_the_process_is_reported_by_pid_with_why(tmp_path: Path) -> None:
    _host_root, dirs = _host(tmp_path)
    proc = tmp_path / "proc"
    proc.mkdir()
    owner = PodResolver(dirs).owners(str(proc), [31337])[31337]
    assert owner.pid == 31337 and owner.pod is None and owner.container is None
    assert "hostPID: true" in owner.reason


def test_host_and_non_kubernetes_processes(tmp_path: Path) -> None:
    _host_root, dirs = _host(tmp_path)
    proc = tmp_path / "proc"
    _proc(proc, 1, "0::/system.slice/ollama.service\n", comm="ollama")
    _proc(proc, 2, f"0::/docker/{CID}\n")
    owners = PodResolver(dirs).owners(str(proc), [1, 2])
    assert owners[1].container is None and owners[1].reason == "host process"
    assert owners[2].container == ContainerRef(CID, "docker") and owners[2].pod is None
    assert owners[2].reason == "container outside Kubernetes"


def test_a_new_pod_triggers_one_rescan(tmp_path: Path) -> None:
    _host_root, dirs = _host(tmp_path)
    proc = tmp_path / "proc"
    _proc(proc, 5, CASES[0][1])
    resolver = PodResolver(dirs)
    resolver.refresh()
    Path(dirs.log_pods, f"ns_late-pod_{UID}").mkdir(parents=True)
    assert resolver.owners(str(proc), [5])[5].pod_name == "late-pod"


def test_unreadable_cgroup_says_so(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "3" / "cgroup").mkdir(parents=True)  # an OSError other than "not there", even for root
    _comm, ref, reason = read_owner(str(proc), 3)
    assert ref is None and "cannot read" in reason


def test_the_live_proc_of_this_process_parses(tmp_path: Path) -> None:
    """Whatever this machine's cgroup layout, our own /proc entry reads without error."""
    comm, _ref, reason = read_owner("/proc", os.getpid())
    assert reason == "" and comm


def test_a_pids_cgroup_is_read_once_while_it_stays_and_afresh_after_it_left(tmp_path: Path) -> None:
    _host_root, dirs = _host(tmp_path)
    proc = tmp_path / "proc"
    _proc(proc, 5, CASES[0][1])
    resolver = PodResolver(dirs)
    assert resolver.owners(str(proc), [5], "GPU-a")[5].container == CASES[0][2]
    (proc / "5" / "cgroup").write_text(CASES[7][1])  # (a pid does not move; this shows what is cached)
    assert resolver.owners(str(proc), [5], "GPU-a")[5].container == CASES[0][2]
    assert resolver.owners(str(proc), [5], "GPU-b")[5].container == CASES[7][2]  # another GPU's list
    resolver.owners(str(proc), [], "GPU-a")  # pid 5 left GPU-a
    assert resolver.owners(str(proc), [5], "GPU-a")[5].container == CASES[7][2]
