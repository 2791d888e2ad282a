"""deploy/bridge/: the cloud-side Deployment of gpu-mapper bridge validates strictly (kubernetes-validate), runs two
replicas of one group, takes the broker credentials from its Secret, probes the endpoints its ConfigMap
configures, and the ConfigMap loads as the bridge's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mapper.bridge.config import BRIDGE_KEYS, load_bridge_settings
from mapper.net.http import parse_metrics_addr
from tests.test_deploy import K8S_VERSIONS

BRIDGE = Path(__file__).resolve().parents[1] / "deploy" / "bridge"


def docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(BRIDGE.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((f"{path.name}[{i}]", doc))
    return out


def one(kind: str) -> dict[str, Any]:
    found = [doc for _, doc in docs() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/bridge/, found {len(found)}"
    return found[0]


def container() -> dict[str, Any]:
    [c] = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(c)


def test_deploy_bridge_holds_a_deployment_its_configmap_secret_and_service() -> None:
    assert sorted(doc["kind"] for _, doc in docs()) == ["ConfigMap", "Deployment", "Secret", "Service"]
    assert {doc["metadata"]["namespace"] for _, doc in docs()} == {"gpu-mapper"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_bridge_manifest_validates_strictly_with_kubernetes_validate(version: str) -> None:
    for where, doc in docs():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} ({version}): {exc.message} at {'.'.join(map(str, exc.path))}")


def test_a_misspelt_field_would_be_caught() -> None:
    dep = one("Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[0], strict=True)


def test_two_replicas_of_one_group_with_a_stable_client_id_each_and_off_the_edge_nodes() -> None:
    dep = one("Deployment")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    env = {e["name"]: e for e in container()["env"]}
    assert env["GPU_MAPPER_BRIDGE_MQTT_CLIENT_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "node-role.kubernetes.io/edge", "operator": "DoesNotExist"} in terms[0]["matchExpressions"]
    assert container()["args"] == ["bridge"]


def test_the_broker_credentials_come_from_the_secret_not_the_configmap() -> None:
    secret = one("Secret")
    env = {e["name"]: e for e in container()["env"]}
    ref = env["GPU_MAPPER_BRIDGE_MQTT_USERNAME"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "username"}
    assert "username" in secret["stringData"] and "password" in secret["stringData"]
    # The password is a file of the Secret's volume (GPU_MAPPER_BRIDGE_MQTT_PASSWORD_FILE), never a variable.
    assert "GPU_MAPPER_BRIDGE_MQTT_PASSWORD" not in env
    path = Path(env["GPU_MAPPER_BRIDGE_MQTT_PASSWORD_FILE"]["value"])
    volumes = {v["name"]: v for v in one("Deployment")["spec"]["template"]["spec"]["volumes"]}
    [mount] = [m for m in container()["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    assert mount["readOnly"] is True
    volume = volumes[mount["name"]]["secret"]
    assert volume["secretName"] == secret["metadata"]["name"]
    assert volume["items"] == [{"key": "password", "path": path.name}]
    assert volume["defaultMode"] & 0o007 == 0, "the password file must not be readable by others"
    text = one("ConfigMap")["data"]["config.yaml"]
    assert "password" not in text and "username" not in text


def test_the_configmap_loads_as_the_bridge_settings_and_the_probes_hit_its_port(tmp_path: Path) -> None:
    (tmp_path / "password").write_text("p\n")
    env = {"GPU_MAPPER_BRIDGE_MQTT_USERNAME": "u", "GPU_MAPPER_BRIDGE_MQTT_PASSWORD_FILE": str(tmp_path / "password")}
    settings = load_bridge_settings(str(BRIDGE / "configmap.yaml"), env=env, flags={})
    assert settings.mqtt.password == "p"
    assert settings.group == "gpu-mapper-bridge" and settings.remote_write_version == 1
    assert settings.shared_filter == "$share/gpu-mapper-bridge/gpu-mapper/+/+/+/telemetry"
    _, port = parse_metrics_addr(settings.metrics_addr)
    c = container()
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert {p["containerPort"] for p in c["ports"]} == {port}
    assert one("Deployment")["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    env_config = next(e["value"] for e in c["env"] if e["name"] == "GPU_MAPPER_BRIDGE_CONFIG")
    assert env_config == mounts["config"] + "/config.yaml"
    assert settings.spool_dir.startswith(mounts["spool"] + "/")


def test_every_key_of_the_bridge_configmap_is_a_key_the_bridge_reads() -> None:
    section = yaml.safe_load(one("ConfigMap")["data"]["config.yaml"])["bridge"]

    def paths(node: dict[str, Any], prefix: str = "") -> list[str]:
        out = []
        for k, v in node.items():
            out.extend(paths(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"])
        return out

    known = {path for path, _ in BRIDGE_KEYS.values()}
    assert set(paths(section)) <= known
