"""deploy/jetson/: the DaemonSet for Jetson nodes validates strictly (kubernetes-validate), needs no NVIDIA runtime,
mounts every host file the Jetson backend reads under its root read-only but the GPU's devfreq device, holds no
capability, and its DeviceModel is the generated nvidia-jetson."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mapper.edge import config as mapper_config
from mapper.edge.gpu.simjetson import profile
from mapper.tools.discover import model_yaml
from tests.test_deploy import K8S_VERSIONS
from tests.test_device_models import assert_valid_kubeedge, crds_available

JETSON = Path(__file__).resolve().parents[1] / "deploy" / "jetson"
#: What JetsonBackend reads, relative to its root (mapper/edge/gpu/jetson.py, docs/jetson.md).
READS = (
    "sys/class/devfreq",
    "sys/devices/virtual/thermal",
    "sys/bus/i2c/devices",
    "proc/device-tree/model",
    "proc/device-tree/serial-number",
    "proc/meminfo",
    "etc/nvpmodel.conf",
    "var/lib/nvpmodel/status",
    "etc/nv_tegra_release",
)


def daemonset() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((JETSON / "daemonset.yaml").read_text())
    return doc


def pod() -> dict[str, Any]:
    spec: dict[str, Any] = daemonset()["spec"]["template"]["spec"]
    return spec


def container() -> dict[str, Any]:
    [c] = pod()["containers"]
    return dict(c)


def env() -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container()["env"]}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_jetson_daemonset_validates_strictly_with_kubernetes_validate(version: str) -> None:
    try:
        kubernetes_validate.validate(daemonset(), version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"deploy/jetson/daemonset.yaml ({version}): {exc.message} at {'.'.join(map(str, exc.path))}")


def test_it_runs_the_jetson_backend_on_jetson_edge_nodes_without_the_nvidia_runtime() -> None:
    assert pod()["nodeSelector"] == {"node-role.kubernetes.io/edge": "", "gpu-mapper.kubeedge.io/jetson": "true"}
    assert "runtimeClassName" not in pod()
    variables = env()
    assert variables[mapper_config.ENV_KEYS["backend"]] == "jetson"
    assert variables[mapper_config.ENV_KEYS["jetson_root"]] == "/host"
    assert not any(name.startswith("NVIDIA_") for name in variables)


def test_every_file_the_backend_reads_is_mounted_under_its_root_and_only_the_gpu_device_is_writable() -> None:
    root = env()[mapper_config.ENV_KEYS["jetson_root"]]
    volumes = {v["name"]: v for v in pod()["volumes"]}
    host_mounts = [m for m in container()["volumeMounts"] if m["mountPath"].startswith(root + "/")]
    for rel in READS:
        path = f"{root}/{rel}"
        assert any(path == m["mountPath"] or path.startswith(m["mountPath"] + "/") for m in host_mounts), rel
    writable = [m for m in host_mounts if not m.get("readOnly")]
    assert [m["name"] for m in writable] == ["host-gpu-device"]
    (gpu,) = writable
    assert volumes[gpu["name"]]["hostPath"]["path"] == gpu["mountPath"].removeprefix(root)
    # The simulated AGX Orin (JetPack 6) has its GPU device where the default mount points.
    assert gpu["mountPath"] == f"{root}/sys/devices/{profile('orin-agx').device_dir}"
    for m in host_mounts:  # each host mount is the same path on the host (the device tree: its link's target)
        host = volumes[m["name"]]["hostPath"]["path"]
        assert host == m["mountPath"].removeprefix(root) or m["name"] == "host-device-tree"


def test_the_container_is_root_without_any_capability_or_privilege() -> None:
    sc = container()["securityContext"]
    assert sc["runAsUser"] == 0 and sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert not pod().get("hostPID") and not pod().get("hostIPC")


def test_every_privilege_carries_a_comment_saying_why() -> None:
    lines = (JETSON / "daemonset.yaml").read_text().splitlines()
    for key in (
        "hostNetwork:",
        "runAsUser:",
        "privileged:",
        "capabilities:",
        "hostPath:",
        "automountServiceAccountToken:",
    ):
        found = [i for i, line in enumerate(lines) if line.strip().startswith(key)]
        assert found, key
        for i in found:
            above = lines[max(0, i - 8) : i]
            assert any(line.strip().startswith("#") for line in above), f"line {i + 1} ({key}) has no comment above"


def test_the_jetson_device_model_is_the_generated_one_and_valid() -> None:
    text = (JETSON / "devicemodel.yaml").read_text()
    assert text == model_yaml(name="nvidia-jetson")
    if crds_available():
        assert_valid_kubeedge(yaml.safe_load(text), "deploy/jetson/devicemodel.yaml")
