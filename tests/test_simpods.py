"""The simulated processes' host tree (``SimNvml.pod_tree``, ``SimPods``), read by the real ``PodResolver``, and
when the composition root reads it instead of the host's ``/proc`` (``mapper.edge.backends.sim_process_roots``)."""

from __future__ import annotations

import stat
from dataclasses import replace
from pathlib import Path

import pytest

from mapper.clock import FakeClock
from mapper.edge.backends import SimulatedNode, sim_process_roots, simulated_node
from mapper.edge.config import Settings, load_settings
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml, SimPods, scenario_pid
from mapper.edge.processes.workloads import PodDirs, PodResolver, ProcessOwner

GIB = 1 << 30


def owners(root: Path, pids: list[int]) -> dict[int, ProcessOwner]:
    """The owners of ``pids`` as the process loop finds them in the tree under ``root``."""
    return PodResolver(PodDirs.under(str(root))).owners(str(root / "proc"), pids)


def named(owner: ProcessOwner) -> tuple[str, str, str]:
    return owner.namespace, owner.pod_name, owner.container_name


def test_every_scenario_process_has_a_pod_of_its_own_named_from_the_kubelets_log_links(
    fake_clock: FakeClock, tmp_path: Path
) -> None:
    sim = SimNvml(2, "H100", seed=0, scenario="inference", clock=fake_clock.monotonic)
    assert sim.pod_tree(tmp_path) == tmp_path
    pids = [p.pid for g in sim.gpus for p, _ in g.processes_at(0.0)]
    assert pids == [1001, 1002, 1101, 1102]
    found = owners(tmp_path, pids)
    assert {pid: named(o) for pid, o in found.items()} == {
        1001: ("demo", "job-0-0", "main"),
        1002: ("demo", "job-0-1", "main"),
        1101: ("demo", "job-1-0", "main"),
        1102: ("demo", "job-1-1", "main"),
    }
    for owner in found.values():
        assert owner.reason == "" and owner.comm == "python3"
        assert owner.pod is not None and owner.pod.source == "log-links"
        assert owner.container is not None and owner.container.runtime == "containerd"
        assert owner.container.qos == "burstable"
    assert len({o.container.container_id for o in found.values() if o.container}) == 4
    assert len({o.pod.uid for o in found.values() if o.pod}) == 4
    # The process's own record says the same pod.
    (first, _), _ = sim.gpus[0].processes_at(0.0)
    assert first.pod == ("demo", "job-0-0", "main")


def test_the_tree_is_the_same_on_every_run_and_the_pod_folders_name_the_pods_too(
    fake_clock: FakeClock, tmp_path: Path
) -> None:
    trees = []
    for run in ("a", "b"):
        sim = SimNvml(1, "H100", seed=run == "b", scenario="steady", clock=fake_clock.monotonic)
        root = sim.pod_tree(tmp_path / run)
        trees.append(sorted(str(p.relative_to(root)) for p in root.rglob("*")))
        assert (root / "proc" / "1001" / "cgroup").read_text() == (
            (tmp_path / "a" / "proc" / "1001" / "cgroup").read_text()
        )
    assert trees[0] == trees[1]
    # Without the log links, the pod's folder in /var/log/pods still names the pod (not the container).
    root = tmp_path / "a"
    for link in (root / "var" / "log" / "containers").iterdir():
        link.unlink()
    (only,) = owners(root, [1001]).values()
    assert (only.namespace, only.pod_name, only.container_name, only.reason) == ("demo", "job-0-0", "", "")
    assert only.pod is not None and only.pod.source == "log-pods"


def test_a_scenario_change_needs_no_rewrite(fake_clock: FakeClock, tmp_path: Path) -> None:
    sim = SimNvml(1, "H100", seed=0, scenario="idle", clock=fake_clock.monotonic)
    sim.pod_tree(tmp_path)
    assert sim.gpus[0].processes_at(0.0) == []
    sim.set_scenario(None, "inference")
    pids = [p.pid for p, _ in sim.gpus[0].processes_at(0.0)]
    assert [named(o) for o in owners(tmp_path, pids).values()] == [
        ("demo", "job-0-0", "main"),
        ("demo", "job-0-1", "main"),
    ]


def test_started_processes_join_their_pod_or_are_host_processes_and_leave_when_stopped(
    fake_clock: FakeClock, tmp_path: Path
) -> None:
    sim = SimNvml(1, "H100", seed=0, scenario="steady", clock=fake_clock.monotonic)
    uuid = sim.gpus[0].uuid
    before = sim.start_process(uuid, 4001, GIB, pod=("ml", "trainer-0", "pytorch"))
    sim.pod_tree(tmp_path)  # a process started before the tree is in it
    sim.start_process(uuid, 4002, GIB, pod=("ml", "trainer-0", "sidecar"))
    sim.start_process(uuid, 4003, GIB, name="xorg")
    found = owners(tmp_path, [before.pid, 4002, 4003])
    assert named(found[4001]) == ("ml", "trainer-0", "pytorch")
    assert named(found[4002]) == ("ml", "trainer-0", "sidecar")
    assert found[4001].pod is not None and found[4002].pod is not None
    assert found[4001].pod.uid == found[4002].pod.uid, "one pod, two containers"
    assert found[4003].container is None and found[4003].reason == "host process" and found[4003].comm == "xorg"

    sim.stop_process(uuid, 4002)
    assert not (tmp_path / "proc" / "4002").exists()
    assert "not visible" in owners(tmp_path, [4002])[4002].reason
    assert named(owners(tmp_path, [4001])[4001]) == ("ml", "trainer-0", "pytorch")

    # A started process that took a scenario pid gives it back to the scenario's pod when it stops.
    sim.set_scenario_processes(uuid, False)
    sim.start_process(uuid, scenario_pid(0, 0), GIB, name="other")
    assert owners(tmp_path, [1001])[1001].reason == "host process"
    sim.stop_process(uuid, 1001)
    assert named(owners(tmp_path, [1001])[1001]) == ("demo", "job-0-0", "main")


def test_pod_uids_and_container_ids_have_the_kubelets_forms() -> None:
    uid = SimPods.pod_uid("demo", "job-0-0")
    assert len(uid) == 36 and uid.count("-") == 4 and uid == SimPods.pod_uid("demo", "job-0-0")
    cid = SimPods.container_id("demo", "job-0-0", "main")
    assert len(cid) == 64 and int(cid, 16) >= 0
    assert cid != SimPods.container_id("demo", "job-0-0", "sidecar")


# --------------------------------------------------------------------------------------------------
# The composition root: the simulator's tree only over the simulator, only where the settings keep the defaults
# --------------------------------------------------------------------------------------------------


def sim_node() -> SimulatedNode | None:
    """The simulated node as the composition root finds it under an NVML backend over the simulator."""
    return simulated_node(NvmlBackend(SimNvml(1, "H100", seed=0, scenario="steady")))


def test_over_the_simulator_with_the_default_roots_the_process_loop_reads_the_simulated_host(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    settings = load_settings(env={}, flags={"sim": 1, "data_dir": str(tmp_path / "data")})
    got, prepare = sim_process_roots(settings, sim_node(), tmp_path / "data")
    host = tmp_path / "data" / "sim-host"
    assert (got.proc_root, got.pod_files_root) == (str(host / "proc"), str(host))
    assert prepare is not None and not host.exists()
    prepare()
    assert stat.S_IMODE(host.stat().st_mode) == 0o700
    assert named(owners(host, [1001])[1001]) == ("demo", "job-0-0", "main")


@pytest.mark.parametrize(
    ("env", "overrides"),
    [
        ({"GPU_MAPPER_PROC_ROOT": "/proc"}, {}),  # given, even at the default's value
        ({"GPU_MAPPER_POD_FILES_ROOT": "/"}, {}),
        ({}, {"proc_root": "/host/proc"}),  # set in code to a value of its own
        ({}, {"pod_files_root": "/host"}),
    ],
)
def test_a_root_the_user_set_is_kept(tmp_path: Path, env: dict[str, str], overrides: dict[str, str]) -> None:
    settings = replace(load_settings(env=env, flags={"sim": 1}), **overrides)
    got, prepare = sim_process_roots(settings, sim_node(), tmp_path)
    assert got is settings and prepare is None


def test_real_gpus_keep_the_hosts_roots(tmp_path: Path) -> None:
    import pynvml  # (the backend is only built: nothing is called on the binding)

    settings = Settings()
    assert simulated_node(NvmlBackend(pynvml)) is None
    got, prepare = sim_process_roots(settings, None, tmp_path)
    assert got is settings and prepare is None
    assert (got.proc_root, got.pod_files_root) == ("/proc", "/")


def test_an_unwritable_data_dir_leaves_the_pods_unnamed_and_the_loop_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    data.write_text("a file where the data dir should be")
    _, prepare = sim_process_roots(Settings(), sim_node(), data)
    assert prepare is not None
    prepare()  # no exception: the warning says why the pods have no names
    assert "their pods are not named" in caplog.text
