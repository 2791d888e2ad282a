"""deploy/: every manifest validates (core kinds with kubernetes-validate, Device and DeviceModel against the
KubeEdge schemas), the DaemonSet has what a GPU edge node needs and says why for each privilege, the ConfigMap
documents every config key and loads, and the Grafana dashboard uses only metrics the collector emits."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mapper.edge import config as mapper_config
from mapper.edge.config import load_settings
from mapper.edge.control.policy import parse_policies
from mapper.edge.status.metrics import metric_names
from mapper.net.http import parse_metrics_addr
from tests.test_device_models import assert_valid_kubeedge, needs_crds

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
#: kubernetes-validate checks against these Kubernetes versions (the project's floor and the newest shipped).
K8S_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
CORE_KINDS = {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"}


def manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((f"{path.name}[{i}]", doc))
    return out


def one(kind: str) -> dict[str, Any]:
    found = [doc for _, doc in manifests() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/, found {len(found)}"
    return found[0]


def container() -> dict[str, Any]:
    pod = one("DaemonSet")["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    c: dict[str, Any] = pod["containers"][0]
    return c


def config_text() -> str:
    text: str = one("ConfigMap")["data"]["config.yaml"]
    return text


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def test_deploy_holds_the_daemonset_configmap_model_and_an_example_device() -> None:
    kinds = sorted(doc["kind"] for _, doc in manifests())
    assert kinds == ["ConfigMap", "DaemonSet", "Device", "DeviceModel", "Namespace", "ServiceAccount"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_core_manifest_validates_strictly_with_kubernetes_validate(version: str) -> None:
    checked = 0
    for where, doc in manifests():
        if doc["kind"] in CORE_KINDS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where} ({version}): {exc.message} at {'.'.join(map(str, exc.path))}")
            checked += 1
    assert checked == len(CORE_KINDS)


def test_kubernetes_validate_would_catch_a_misspelt_field() -> None:
    ds = one("DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSIONS[0], strict=True)


@needs_crds
def test_the_device_model_and_example_device_validate_against_the_kubeedge_schemas() -> None:
    checked = 0
    for where, doc in manifests():
        if doc["kind"] in ("Device", "DeviceModel"):
            assert_valid_kubeedge(doc, where)
            checked += 1
    assert checked == 2


def test_every_namespaced_object_of_the_mapper_is_in_its_namespace() -> None:
    ns = one("Namespace")["metadata"]["name"]
    for kind in ("ServiceAccount", "ConfigMap", "DaemonSet"):
        assert one(kind)["metadata"]["namespace"] == ns


# --------------------------------------------------------------------------------------------------
# The DaemonSet
# --------------------------------------------------------------------------------------------------


def test_the_daemonset_runs_on_kubeedge_edge_nodes_only() -> None:
    pod = one("DaemonSet")["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["node-role.kubernetes.io/edge"] == ""
    keys = {t["key"] for t in pod["tolerations"]}
    assert "node-role.kubernetes.io/edge" in keys
    assert pod["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False


def test_the_daemonset_requests_and_limits_match_the_issue() -> None:
    res = container()["resources"]
    assert res["requests"] == {"cpu": "200m", "memory": "256Mi"}
    assert res["limits"] == {"cpu": "500m", "memory": "512Mi"}


def test_the_probes_hit_healthz_and_readyz_on_the_configured_metrics_port() -> None:
    c = container()
    settings = load_settings(str(DEPLOY / "configmap.yaml"), env={"GPU_MAPPER_NODE_NAME": "edge1"})
    _, port = parse_metrics_addr(settings.metrics_addr)
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert {p["containerPort"] for p in c["ports"]} == {port}
    annotations = one("DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)


def test_nvml_comes_through_the_nvidia_runtime_class_without_privileged_mode() -> None:
    pod = one("DaemonSet")["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    env = {e["name"]: e for e in container()["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "compute,utility"
    assert container()["securityContext"]["privileged"] is False


def test_the_container_holds_only_the_privilege_that_power_limits_need() -> None:
    sc = container()["securityContext"]
    assert sc["runAsUser"] == 0
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    pod = one("DaemonSet")["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert not pod.get("hostIPC")


def test_every_privilege_in_the_daemonset_carries_a_comment_saying_why() -> None:
    lines = (DEPLOY / "daemonset.yaml").read_text().splitlines()
    for key in (
        "hostNetwork:",
        "runtimeClassName:",
        "runAsUser:",
        "privileged:",
        "allowPrivilegeEscalation:",
        "readOnlyRootFilesystem:",
        "capabilities:",
        "automountServiceAccountToken:",
        "hostPath:",
        "hostPID:",
    ):
        found = [i for i, line in enumerate(lines) if line.strip().startswith(key)]
        assert found, key
        for i in found:
            above = lines[max(0, i - 8) : i]
            assert any(line.strip().startswith("#") for line in above), f"line {i + 1} ({key}) has no comment above"


def test_the_daemonset_mounts_the_sockets_config_and_data_dir_where_the_config_points() -> None:
    ds = one("DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in ds["volumes"]}
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    settings = load_settings(str(DEPLOY / "configmap.yaml"), env={"GPU_MAPPER_NODE_NAME": "edge1"})

    def host_path_of(path: str) -> str:
        parent = str(Path(path).parent) if not path.endswith("/") else path
        m = mounts.get(path) or mounts[parent]
        vol = volumes[m["name"]]
        return str(vol["hostPath"]["path"])

    assert host_path_of(settings.edgecore_socket) == "/etc/kubeedge"
    assert host_path_of(settings.socket) == "/etc/kubeedge"
    assert host_path_of(settings.data_dir) == settings.data_dir
    env = {e["name"]: e for e in container()["env"]}
    config_path = env["GPU_MAPPER_CONFIG"]["value"]
    config_mount = mounts[str(Path(config_path).parent)]
    assert volumes[config_mount["name"]]["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    assert Path(config_path).name in one("ConfigMap")["data"]
    assert env["GPU_MAPPER_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["GPU_MAPPER_NODE_NAME"]["name"] == mapper_config.ENV_KEYS["node_name"]


def test_the_process_cycle_sees_host_pids_and_reads_the_pod_folders_read_only_where_the_config_points() -> None:
    from mapper.edge.processes.workloads import PodDirs

    pod = one("DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    settings = load_settings(str(DEPLOY / "configmap.yaml"), env={"GPU_MAPPER_NODE_NAME": "edge1"})
    assert settings.process_interval_s == 5.0 and settings.proc_root == "/proc"
    dirs = PodDirs.under(settings.pod_files_root)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    for path in (dirs.log_pods, dirs.log_containers):
        mount = mounts[path]
        assert mount["readOnly"] is True, f"{path} must be mounted read only"
        assert volumes[mount["name"]]["hostPath"]["path"] == path
    # Nothing else of the host's processes or the kubelet's state: no token or volume folder is mounted.
    assert not any(p.startswith(("/var/lib/kubelet", "/proc", "/host")) for p in mounts)


def test_the_mqtt_password_comes_from_a_mounted_secret_file_not_the_configmap_or_the_environment() -> None:
    env = {e["name"]: e for e in container()["env"]}
    assert mapper_config.ENV_KEYS["mqtt_password"] not in env
    path = Path(env[mapper_config.ENV_KEYS["mqtt_password_file"]]["value"])
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    mount = mounts[str(path.parent)]
    assert mount["readOnly"] is True
    volumes = {v["name"]: v for v in one("DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    secret = volumes[mount["name"]]["secret"]
    assert secret["optional"] is True and secret["defaultMode"] == 0o400
    # The Secret's key is the file's name (kubectl create secret generic gpu-mapper-mqtt --from-literal=password=)
    assert path.name == "password"
    # Without the Secret (no file) and without a user name the ConfigMap's settings load, with no password.
    settings = load_settings(
        str(DEPLOY / "configmap.yaml"),
        env={"GPU_MAPPER_NODE_NAME": "edge1", mapper_config.ENV_KEYS["mqtt_password_file"]: str(path)},
    )
    assert settings.mqtt.password is None


# --------------------------------------------------------------------------------------------------
# The ConfigMap
# --------------------------------------------------------------------------------------------------


def test_the_configmap_loads_as_the_mappers_settings_with_valid_policies() -> None:
    settings = load_settings(str(DEPLOY / "configmap.yaml"), env={"GPU_MAPPER_NODE_NAME": "edge1"})
    assert settings.node_name == "edge1"
    assert settings.sim == 0, "the deployed mapper must use the real GPUs"
    assert settings.dmi_enabled
    policies = parse_policies(settings.policies)
    assert policies.thermal.max_temp_c == 85
    assert policies.thermal.cool_down_s == 300


def test_the_configmap_lists_every_config_key_the_mapper_reads() -> None:
    doc = yaml.safe_load(config_text())
    missing = []
    for key_path, _ in mapper_config._FILE_KEYS.values():
        node: Any = doc
        for part in key_path.split("."):
            if not isinstance(node, dict) or part not in node:
                missing.append(key_path)
                break
            node = node[part]
    assert not missing, f"config keys not in deploy/configmap.yaml: {missing}"
    for section in ("thermalThrottling", "powerSaving", "health", "dryRun", "minChangeInterval"):
        assert section in doc["policies"]


def test_every_key_of_the_configmap_is_documented_by_a_comment() -> None:
    lines = config_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z]+):(.*)$", line)
        if not m or not m.group(3).strip():
            continue  # not a key, or a section header (its keys carry the comments)
        indent = len(m.group(1))
        # Documented: a comment right above, or a comment above a run of sibling keys it belongs to.
        j = i - 1
        while j >= 0 and re.match(r"^\s*[A-Za-z]+:", lines[j]) and len(lines[j]) - len(lines[j].lstrip()) == indent:
            j -= 1
        has_comment = j >= 0 and lines[j].strip().startswith("#")
        opens_section = j >= 0 and lines[j].rstrip().endswith(":") and not lines[j].strip().startswith("#")
        if not (has_comment or opens_section or "#" in line):
            undocumented.append(line.strip())
    assert not undocumented, f"keys without a comment: {undocumented}"


# --------------------------------------------------------------------------------------------------
# The Grafana dashboard
# --------------------------------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DEPLOY / "grafana" / "gpu-mapper.json").read_text())
    return loaded


def exprs(dash: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return out


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset"}


def metric_refs(expr: str) -> set[str]:
    """Metric names in a PromQL expression (identifiers followed by ``{``, ``[`` or used bare, not functions,
    label names in ``by (...)``, or quoted strings)."""
    # Grafana: label_values(metric, label), the metric's selector with commas of its own
    text = re.sub(r"label_values\(([^,{)]+(?:\{[^}]*\})?)\s*(,[^)]*)?\)", r"\1", expr)
    text = re.sub(r'"[^"]*"', '""', text)
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\{[^}]*\}", "{}", text)
    text = re.sub(r"\[[^\]]*\]", "[]", text)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word = m.group(0)
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or word in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def test_the_dashboard_matches_its_builder() -> None:
    out = subprocess.run(
        [sys.executable, str(DEPLOY / "grafana" / "build_dashboard.py")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == dashboard(), (
        "run deploy/grafana/build_dashboard.py > deploy/grafana/gpu-mapper.json"
    )


def test_the_preview_page_holds_the_dashboard_itself() -> None:
    """deploy/grafana/preview.html draws the panels of the JSON it embeds: that JSON is gpu-mapper.json's."""
    page = (DEPLOY / "grafana" / "preview.html").read_text()
    m = re.search(r'<script id="dashboard" type="application/json">\n(.*?)\n</script>', page, re.DOTALL)
    assert m is not None, "preview.html has no dashboard element"
    assert json.loads(m.group(1)) == dashboard(), "run python3 deploy/grafana/build_dashboard.py --preview"


def test_every_dashboard_expression_uses_only_metrics_the_collector_emits() -> None:
    known = metric_names()
    used: set[str] = set()
    for expr in exprs(dashboard()):
        refs = metric_refs(expr)
        assert refs, f"no metric found in {expr!r}"
        unknown = refs - known
        assert not unknown, f"{expr!r} uses {sorted(unknown)}, which mapper/edge/status/metrics.py does not emit"
        used |= refs
    for needed in (
        "gpu_power_usage_watts",
        "gpu_power_limit_enforced_watts",
        "gpu_temperature_celsius",
        "gpu_utilization_ratio",
        "gpu_clock_sm_hertz",
        "gpu_clock_event_reason_active",
        "gpu_mapper_buffer_bytes",
    ):
        assert needed in used, f"the dashboard shows no {needed}"


def test_the_metric_reference_parser_finds_names_and_skips_functions_and_labels() -> None:
    expr = 'sum by (instance, le) (rate(gpu_mapper_collect_duration_seconds_bucket{instance=~"$i"}[5m])) > 0'
    assert metric_refs(expr) == {"gpu_mapper_collect_duration_seconds_bucket"}
    assert metric_refs("gpu_a / gpu_b") == {"gpu_a", "gpu_b"}
    assert metric_refs('label_values(gpu_info{node=~"$node"}, uuid)') == {"gpu_info"}
    assert metric_refs('label_values(gpu_info{job="$job", node=~"$node"}, uuid)') == {"gpu_info"}


def test_the_dashboard_has_node_and_gpu_variables_and_unique_panel_ids() -> None:
    dash = dashboard()
    names = [v["name"] for v in dash["templating"]["list"]]
    assert {"datasource", "node", "gpu"} <= set(names)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for word in ("power", "temperature", "utilisation", "clocks", "throttle", "backlog", "draw vs cap"):
        assert word in titles


# --------------------------------------------------------------------------------------------------
# The image: the Containerfile (for podman/docker build) and scripts/build-image.sh (no registry) agree
# --------------------------------------------------------------------------------------------------


def test_the_containerfile_and_the_build_script_make_the_same_image() -> None:
    """tests/test_image.py builds and runs the script's image; the Containerfile needs a registry to build, so
    here it is checked to set up what the script sets up."""
    containerfile = (REPO / "Containerfile").read_text()
    script = (REPO / "scripts" / "build-image.sh").read_text()
    assert containerfile.count("FROM ") == 2  # a build stage and the final one
    final = containerfile.rsplit("FROM ", 1)[1]
    assert final.startswith("docker.io/library/debian:bookworm-slim")
    # The final stage installs Debian's python3 and CA certificates only, as the script's root filesystem.
    assert re.search(r"apt-get install -y --no-install-recommends python3 ca-certificates\s", final)
    assert "PACKAGES=python3,ca-certificates" in script
    for tool in ("gcc", "build-essential", "python3-pip", "python3-venv", "pytest"):
        assert tool not in final, tool
    # Same entrypoint, command, environment, port, user and install path.
    assert 'ENTRYPOINT ["/usr/local/bin/gpu-mapper"]' in final and 'ENTRYPOINT ["/usr/local/bin/gpu-mapper"]' in script
    assert 'CMD ["run"]' in final and 'CMD ["run"]' in script
    env = "ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 GPU_MAPPER_DATA_DIR=/var/lib/gpu-mapper"
    assert env in final and env in script
    for line in ("EXPOSE 9410/tcp", "USER 0:0", "WORKDIR /"):
        assert line in final and line in script, line
    assert "usr/local/lib/python3.11/dist-packages" in containerfile and "usr/local/lib/python${PY_VERSION}" in script
    labels = set(re.findall(r"org\.opencontainers\.image\.([a-z.]+)=", final))
    assert labels == set(re.findall(r"label org\.opencontainers\.image\.([a-z.]+) ", script))
    assert {"title", "version", "revision", "created", "licenses", "source", "description"} <= labels
    version = re.search(r'^version = "(.*)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert version is not None and f"ARG VERSION={version.group(1)}" in final
    assert container()["image"].endswith(":" + version.group(1))
