"""Files, secrets and least privilege: the data directory 0700 and its files 0600, secrets read from files and
never logged, and the mapper run as a non-root user over the simulated NVML (reads work, setters are refused)."""

from __future__ import annotations

import base64
import contextlib
import os
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from mapper.bridge.config import load_bridge_settings
from mapper.edge.config import load_settings
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.status.metrics import fetch_status
from mapper.edge.status.stats import MapperSnapshot
from mapper.edge.storage.datadir import prepare_data_dir
from mapper.errors import ConfigError
from tests.apphelpers import fast_settings, running_app, setpriv_as, wait_for
from tests.bridgehelpers import ReceiverServer
from tests.brokers import Mosquitto, free_port, password_file

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534
KEEP_USER = "user root\n" if os.geteuid() == 0 else ""


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@contextlib.contextmanager
def umask(value: int) -> Iterator[None]:
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


# --------------------------------------------------------------------------------------------------
# The data directory
# --------------------------------------------------------------------------------------------------


def test_a_new_data_directory_is_0700_and_its_files_0600_whatever_the_umask(tmp_path: Path) -> None:
    target = tmp_path / "a" / "data"
    with umask(0o000):
        assert prepare_data_dir(target, ("telemetry.db", "desired.db")) == []
    assert mode(target) == 0o700
    assert mode(target / "telemetry.db") == 0o600 and mode(target / "desired.db") == 0o600


def test_a_wider_existing_directory_of_the_mappers_files_and_those_files_are_tightened(tmp_path: Path) -> None:
    target = tmp_path / "data"
    target.mkdir()
    target.chmod(0o755)  # an empty hostPath the kubelet made, then an earlier run's files
    (target / "telemetry.db").write_bytes(b"")
    (target / "telemetry.db").chmod(0o644)
    (target / "status.json").write_text("{}")
    (target / "status.json").chmod(0o666)
    assert prepare_data_dir(target, ("telemetry.db",)) == []
    assert mode(target) == 0o700
    assert mode(target / "telemetry.db") == 0o600 and mode(target / "status.json") == 0o600
    assert (target / "status.json").read_text() == "{}"  # tightened, not rewritten


def test_an_existing_directory_with_other_files_keeps_its_mode_and_theirs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The mapper changes the mode only of what is its own: a directory that holds anything else (``--data-dir
    /etc`` or a home directory) keeps its mode, and so does every file in it that is not the mapper's."""
    target = tmp_path / "shared"
    target.mkdir()
    target.chmod(0o755)
    (target / "notes.txt").write_text("x")
    (target / "notes.txt").chmod(0o644)
    (target / "private").write_text("x")
    (target / "private").chmod(0o400)
    (target / "status.json").write_text("{}")
    (target / "status.json").chmod(0o644)
    with caplog.at_level("WARNING", logger="mapper.edge.storage.datadir"):
        assert prepare_data_dir(target, ("telemetry.db",)) == []
    assert mode(target) == 0o755 and mode(target / "notes.txt") == 0o644 and mode(target / "private") == 0o400
    assert mode(target / "status.json") == 0o600 and mode(target / "telemetry.db") == 0o600, "the mapper's own"
    assert "holds entries that are not the mapper's (notes.txt, private)" in caplog.text


def test_a_data_dir_at_a_file_keeps_that_files_mode_and_is_refused_saying_so(tmp_path: Path) -> None:
    from mapper.edge.storage.datadir import require_data_dir
    from mapper.errors import PermanentError

    target = tmp_path / "hostname"
    target.write_text("edge-1\n")
    target.chmod(0o755)
    with pytest.raises(PermanentError, match=r"a file is there, not a directory; left as it was"):
        require_data_dir(target, ("telemetry.db", "desired.db"))
    assert mode(target) == 0o755 and target.read_text() == "edge-1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostname"], "nothing made beside it"


def test_the_mapper_started_on_a_file_as_its_data_dir_exits_1_and_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    target = tmp_path / "hostname"
    target.write_text("edge-1\n")
    target.chmod(0o755)
    out = subprocess.run(
        [sys.executable, "-m", "mapper.cli", "run", "--sim", "1", "--node-name", "edge-1", "--data-dir", str(target)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert f"data dir {target}: a file is there, not a directory" in out.stderr
    assert "Traceback" not in out.stderr
    assert mode(target) == 0o755 and target.read_text() == "edge-1\n"


def test_a_directory_the_mapper_cannot_tighten_is_reported_with_the_reason(tmp_path: Path) -> None:
    # A directory owned by another user: chmod is refused (EPERM). As root, the check runs as nobody over a
    # root-owned directory; as any other user, over a root-owned directory of the system.
    if os.geteuid() == 0:
        shared = Path(tempfile.mkdtemp(prefix="gpu-mapper-perm-"))
        try:
            shared.chmod(0o755)
            code = (
                "import sys; from mapper.edge.storage.datadir import prepare_data_dir; "
                f"problems = prepare_data_dir({str(shared)!r}); print('\\n'.join(problems)); "
                "sys.exit(0 if problems else 1)"
            )
            out = subprocess.run(
                [*setpriv_as(NOBODY), sys.executable, "-c", code],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            problems = out.stdout
            assert mode(shared) == 0o755
        finally:
            shared.rmdir()
    else:
        shared = Path("/usr/share/doc")
        problems = "\n".join(prepare_data_dir(shared)[:1])
    assert f"{shared} is 0755 and cannot be made 0700" in problems
    assert "Operation not permitted" in problems and "owned by uid 0" in problems


async def test_the_running_mapper_leaves_only_private_files_in_its_data_directory(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)  # what the kubelet makes of a hostPath DirectoryOrCreate
    sim = SimNvml(1, "H100", seed=0, scenario="steady")
    settings = fast_settings(str(data), devices_dir=str(tmp_path / "devices"))
    (tmp_path / "devices").mkdir()
    with umask(0o022):  # the usual umask: SQLite would make its files 0644
        async with running_app(settings, sim, housekeeping_interval_s=0.2) as app:
            await wait_for(lambda: (data / "status.json").exists(), what="status.json")
            await wait_for(lambda: app.buffer is not None and app.buffer.stats().batches >= 1, what="a batch")
            assert (data / "telemetry.db-wal").exists()
    assert mode(data) == 0o700
    files = sorted(p.name for p in data.iterdir())
    assert {"telemetry.db", "desired.db", "status.json"} <= set(files)
    wide = {name: oct(mode(data / name)) for name in files if mode(data / name) & 0o077}
    assert not wide, f"files readable by others: {wide}"


async def test_the_running_mapper_in_a_directory_with_other_files_touches_only_its_own(tmp_path: Path) -> None:
    data = tmp_path / "shared"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    (data / "left-over.json").write_text("{}")
    (data / "left-over.json").chmod(0o644)
    sim = SimNvml(1, "H100", seed=0, scenario="steady")
    settings = fast_settings(str(data), devices_dir=str(tmp_path / "devices"))
    (tmp_path / "devices").mkdir()
    with umask(0o022):
        async with running_app(settings, sim, housekeeping_interval_s=0.2) as app:
            await wait_for(lambda: (data / "status.json").exists(), what="status.json")
            await wait_for(lambda: app.buffer is not None and app.buffer.stats().batches >= 1, what="a batch")
    assert mode(data) == 0o755 and mode(data / "left-over.json") == 0o644, "not the mapper's: as they were"
    own = [p.name for p in data.iterdir() if p.name != "left-over.json"]
    assert {"telemetry.db", "desired.db", "status.json"} <= set(own)
    wide = {name: oct(mode(data / name)) for name in own if mode(data / name) & 0o077}
    assert not wide, f"the mapper's files readable by others: {wide}"


# --------------------------------------------------------------------------------------------------
# Secrets from files
# --------------------------------------------------------------------------------------------------


def test_the_mqtt_password_comes_from_a_file_without_its_trailing_newline(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("pa ss\n")
    env = {
        "GPU_MAPPER_NODE_NAME": "edge-1",
        "GPU_MAPPER_MQTT_USERNAME": "m",
        "GPU_MAPPER_MQTT_PASSWORD_FILE": str(secret),
    }
    assert load_settings(env=env).mqtt.password == "pa ss"
    flags = {"mqtt_password_file": str(secret)}
    assert load_settings(env={"GPU_MAPPER_NODE_NAME": "edge-1"}, flags=flags).mqtt.password == "pa ss"
    config = tmp_path / "config.yaml"
    config.write_text(f"nodeName: edge-1\nmqtt:\n  username: m\n  passwordFile: {secret}\n")
    settings = load_settings(str(config), env={})
    assert settings.mqtt.password == "pa ss"
    assert "pa ss" not in repr(settings)


def test_a_password_file_that_is_missing_empty_or_given_with_a_password_is_refused_by_name(tmp_path: Path) -> None:
    base = {"GPU_MAPPER_NODE_NAME": "edge-1", "GPU_MAPPER_MQTT_USERNAME": "m"}
    with pytest.raises(ConfigError, match=r"mqtt.passwordFile: cannot read .*/nope: No such file"):
        load_settings(env={**base, "GPU_MAPPER_MQTT_PASSWORD_FILE": str(tmp_path / "nope")})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_settings(env={**base, "GPU_MAPPER_MQTT_PASSWORD_FILE": str(empty)})
    secret = tmp_path / "pw"
    secret.write_text("x-secret-x")
    with pytest.raises(ConfigError, match="both set") as err:
        load_settings(env={**base, "GPU_MAPPER_MQTT_PASSWORD_FILE": str(secret), "GPU_MAPPER_MQTT_PASSWORD": "y"})
    assert "x-secret-x" not in str(err.value)
    # No user name: an absent file is an optional Secret that was not created, and means no credentials.
    settings = load_settings(env={"GPU_MAPPER_NODE_NAME": "edge-1", "GPU_MAPPER_MQTT_PASSWORD_FILE": "/nope/pw"})
    assert settings.mqtt.password is None


def test_every_secret_of_the_bridge_comes_from_a_file_too(tmp_path: Path) -> None:
    mqtt_pw, rw_pw, key_pw = tmp_path / "mqtt-pw", tmp_path / "rw-pw", tmp_path / "key-pw"
    mqtt_pw.write_text("mqtt secret\n")
    rw_pw.write_text("rw-secret\n")
    key_pw.write_text("key-secret\n")
    base = {"GPU_MAPPER_BRIDGE_MQTT_URL": "mqtts://broker:8883", "GPU_MAPPER_BRIDGE_REMOTE_WRITE": "http://p/w"}
    env = {
        **base,
        "GPU_MAPPER_BRIDGE_MQTT_PASSWORD_FILE": str(mqtt_pw),
        "GPU_MAPPER_BRIDGE_REMOTE_WRITE_USERNAME": "rw",
        "GPU_MAPPER_BRIDGE_REMOTE_WRITE_PASSWORD_FILE": str(rw_pw),
        "GPU_MAPPER_BRIDGE_MQTT_CERT_FILE": "/tls/tls.crt",
        "GPU_MAPPER_BRIDGE_MQTT_KEY_FILE": "/tls/tls.key",
        "GPU_MAPPER_BRIDGE_MQTT_KEY_PASSWORD_FILE": str(key_pw),
    }
    s = load_bridge_settings(env=env)
    assert (s.mqtt.password, s.remote_write_password, s.mqtt.key_password) == ("mqtt secret", "rw-secret", "key-secret")
    assert not {"mqtt secret", "rw-secret", "key-secret"} & set(repr(s).split("'"))
    # The same from the config file's keys and from flags.
    config = tmp_path / "config.yaml"
    config.write_text(
        f"bridge:\n  mqtt:\n    passwordFile: {mqtt_pw}\n  remoteWrite:\n    username: rw\n    passwordFile: {rw_pw}\n"
    )
    s = load_bridge_settings(str(config), env=base)
    assert (s.mqtt.password, s.remote_write_password) == ("mqtt secret", "rw-secret")
    s = load_bridge_settings(env=base, flags={"mqtt_password_file": str(mqtt_pw)})
    assert s.mqtt.password == "mqtt secret"
    # A value and a file for one secret, a missing file, a key passphrase with no key: refused by name.
    with pytest.raises(ConfigError, match=r"bridge\.mqtt\.password and bridge\.mqtt\.passwordFile are both set"):
        load_bridge_settings(env={**base, "GPU_MAPPER_BRIDGE_MQTT_PASSWORD": "x"}, flags={"mqtt_password_file": "f"})
    with pytest.raises(ConfigError, match=r"bridge.remoteWrite.passwordFile: cannot read .*/nope"):
        load_bridge_settings(env={**base, "GPU_MAPPER_BRIDGE_REMOTE_WRITE_PASSWORD_FILE": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match=r"bridge\.mqtt\.keyPasswordFile: set, but there is no bridge\.mqtt\.keyFile"):
        load_bridge_settings(env={**base, "GPU_MAPPER_BRIDGE_MQTT_KEY_PASSWORD_FILE": str(key_pw)})


# --------------------------------------------------------------------------------------------------
# The whole mapper as a process: secrets never logged, a warning for one on the command line
# --------------------------------------------------------------------------------------------------


class MapperProcess:
    """``gpu-mapper run`` in a child process (optionally as another user), its log in a file."""

    def __init__(
        self,
        argv: list[str],
        log_path: Path,
        *,
        run_as: int | None = None,
        env: dict[str, str] | None = None,
        command: str = "run",
    ):
        self.port = free_port()
        self.log_path = log_path
        prefix = []
        if run_as is not None:
            prefix = setpriv_as(run_as)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_MAPPER_")}
        full_env.update(env or {})
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "mapper.cli", command, "--metrics-addr", f"127.0.0.1:{self.port}", *argv],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, predicate, what: str, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the mapper exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            with contextlib.suppress(Exception):
                value = predicate()
                if value:
                    return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log()[-3000:]}")

    def status(self) -> MapperSnapshot:
        return fetch_status(self.url, timeout_s=2)

    def healthy(self) -> bool:
        with urllib.request.urlopen(self.url + "/healthz", timeout=2) as resp:
            return bool(resp.status == 200)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def _http_status(url: str, authorization: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": authorization})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.mark.timeout(90)
def test_no_secret_appears_in_a_debug_log_and_one_on_the_command_line_is_warned_about(tmp_path: Path) -> None:
    from_file, on_cli = "file-secret-7f3a91", "cli-secret-2b8e44"
    broker_dir = tmp_path / "broker"
    broker_dir.mkdir()
    pwfile = password_file(broker_dir, {"gpu-mapper": from_file, "cli-user": on_cli})
    broker = Mosquitto(broker_dir, extra_config=f"{KEEP_USER}allow_anonymous false\npassword_file {pwfile}\n")
    broker.start()
    secret = tmp_path / "password"
    secret.write_text(from_file + "\n")
    devices = tmp_path / "devices"
    devices.mkdir()
    common = [
        "--sim",
        "1",
        "--devices",
        str(devices),
        "--node-name",
        "edge-1",
        "--log-level",
        "DEBUG",
        "--mqtt",
        broker.url,
    ]
    # The endpoints' basic-auth password (and its bcrypt hash) must not be logged either.
    import bcrypt

    web_pw = "web-secret-c0ffee"
    web_hash = bcrypt.hashpw(web_pw.encode(), bcrypt.gensalt(4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: {web_hash}\n")
    runs = [
        ("file", [*common, "--data-dir", str(tmp_path / "d1"), "--web-config-file", str(web)],
         {"GPU_MAPPER_MQTT_USERNAME": "gpu-mapper", "GPU_MAPPER_MQTT_PASSWORD_FILE": str(secret)}),
        ("cli", [*common, "--data-dir", str(tmp_path / "d2"), "--mqtt-username", "cli-user", "--mqtt-password", on_cli],
         {}),
    ]  # fmt: skip
    try:
        for name, argv, env in runs:
            mapper = MapperProcess(argv, tmp_path / f"{name}.log", env=env)
            try:
                mapper.wait(lambda m=mapper: "connected as" in m.log(), f"{name}: the mapper connected to the broker")
                if name == "file":
                    auth = "Basic " + base64.b64encode(f"prometheus:{web_pw}".encode()).decode()
                    wrong = "Basic " + base64.b64encode(b"prometheus:not-" + web_pw.encode()).decode()
                    assert _http_status(mapper.url + "/metrics", wrong) == 401
                    mapper.wait(lambda m=mapper, a=auth: _http_status(m.url + "/status", a) == 200, "/status with auth")
                else:
                    mapper.wait(lambda m=mapper: m.status().mqtt_connected, f"{name}: /status says connected")
            finally:
                assert mapper.stop() == 0, mapper.log()[-3000:]
            text = mapper.log()
            assert " DEBUG " in text, "the run did not log at DEBUG level"
            assert from_file not in text and on_cli not in text, f"{name}: a secret is in the log"
            assert web_pw not in text and web_hash not in text and web_hash[7:29] not in text
            warned = "--mqtt-password on the command line is visible to every local user" in text
            assert warned == (name == "cli"), text[-2000:]
    finally:
        broker.stop()


class _AuthReceiver(ReceiverServer):
    """A remote-write receiver that wants basic auth: 204 for the right (user, password), else 401. It records
    the answers it gave."""

    def __init__(self, user: str, password: str) -> None:
        import http.server

        want = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        answers = self.answers = []  # type: list[int]

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                status = 204 if self.headers.get("Authorization") == want else 401
                answers.append(status)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        super().__init__(Handler)


@pytest.mark.timeout(120)
def test_the_bridge_logs_no_secret_at_debug_and_warns_about_one_on_the_command_line(tmp_path: Path) -> None:
    import paho.mqtt.client as paho

    from tests.bridgehelpers import Published, states, stream

    mqtt_pw, rw_pw = "bridge-mqtt-secret-41d9", "bridge-rw-secret-77ae"
    broker_dir = tmp_path / "broker"
    broker_dir.mkdir()
    pwfile = password_file(broker_dir, {"bridge": mqtt_pw, "publisher": "pub-pw"})
    broker = Mosquitto(broker_dir, extra_config=f"{KEEP_USER}allow_anonymous false\npassword_file {pwfile}\n")
    broker.start()
    receiver = _AuthReceiver("rw", rw_pw)
    (tmp_path / "mqtt-pw").write_text(mqtt_pw + "\n")
    (tmp_path / "rw-pw").write_text(rw_pw + "\n")
    publisher = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="publisher")
    publisher.username_pw_set("publisher", "pub-pw")
    publisher.connect("127.0.0.1", broker.port)
    publisher.loop_start()
    common = ["--mqtt", broker.url, "--mqtt-username", "bridge", "--remote-write", receiver.url,
              "--remote-write-username", "rw", "--log-level", "DEBUG", "--batch-max-delay", "0.2s"]  # fmt: skip
    runs = [
        ("file", ["--mqtt-client-id", "bridge-file", "--spool-dir", str(tmp_path / "s1")],
         {"GPU_MAPPER_BRIDGE_MQTT_PASSWORD_FILE": str(tmp_path / "mqtt-pw"),
          "GPU_MAPPER_BRIDGE_REMOTE_WRITE_PASSWORD_FILE": str(tmp_path / "rw-pw")}),
        ("cli", ["--mqtt-client-id", "bridge-cli", "--spool-dir", str(tmp_path / "s2"),
                 "--mqtt-password", mqtt_pw, "--remote-write-password", rw_pw], {}),
    ]  # fmt: skip
    try:
        for i, (name, argv, env) in enumerate(runs):
            batches = stream(gpus=1, seconds=30, window_s=1.0, seed=10 + i, boot_id=f"b00t{i}")
            for topic, payload in states(batches):
                publisher.publish(topic, payload, qos=1, retain=True).wait_for_publish(5)
            bridge = MapperProcess([*common, *argv], tmp_path / f"bridge-{name}.log", env=env, command="bridge")
            try:
                bridge.wait(lambda b=bridge: "connected as" in b.log(), f"{name}: the bridge connected to the broker")
                sent = iter(batches)

                def written(sent: Iterator[Published] = sent) -> bool:
                    # One batch per look until the bridge's shared subscription is in place and a write got 204.
                    if 204 not in receiver.answers:
                        p = next(sent)
                        publisher.publish(p.topic, p.payload, qos=1).wait_for_publish(5)
                    return 204 in receiver.answers

                bridge.wait(written, f"{name}: a remote write with the password", timeout_s=60)
            finally:
                assert bridge.stop() == 0, bridge.log()[-3000:]
            assert 401 not in receiver.answers, receiver.answers
            receiver.answers.clear()
            text = bridge.log()
            assert " DEBUG " in text, "the run did not log at DEBUG level"
            assert mqtt_pw not in text and rw_pw not in text, f"{name}: a secret is in the log"
            for flag, file_flag in (("--mqtt-password", "--mqtt-password-file"),
                                    ("--remote-write-password", "--remote-write-password-file")):  # fmt: skip
                warned = f"{flag} on the command line is visible to every local user" in text
                assert warned == (name == "cli"), text[-2000:]
                assert not warned or f"use {file_flag}" in text
    finally:
        publisher.loop_stop()
        publisher.disconnect()
        receiver.close()
        broker.stop()


# --------------------------------------------------------------------------------------------------
# Least privilege: the mapper as a non-root user
# --------------------------------------------------------------------------------------------------

DESIRED_DEVICE = """
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {{name: gpu0, namespace: default}}
spec:
  deviceModelRef: {{name: nvidia-gpu}}
  nodeName: edge-1
  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}
  properties:
  - {{name: power_usage, collectCycle: 1000, reportCycle: 1000}}
  - {{name: temperature, collectCycle: 1000, reportCycle: 1000}}
  - {{name: power_limit, collectCycle: 1000, reportCycle: 1000, desired: {{value: "300"}}}}
  - {{name: locked_gpu_clock_min, collectCycle: 1000, reportCycle: 1000, desired: {{value: "1005"}}}}
  - {{name: locked_gpu_clock_max, collectCycle: 1000, reportCycle: 1000, desired: {{value: "1755"}}}}
  - {{name: locked_memory_clock_min, collectCycle: 1000, reportCycle: 1000, desired: {{value: "2619"}}}}
  - {{name: locked_memory_clock_max, collectCycle: 1000, reportCycle: 1000, desired: {{value: "2619"}}}}
  - {{name: persistence_mode, collectCycle: 1000, reportCycle: 1000, desired: {{value: "on"}}}}
  - {{name: compute_mode, collectCycle: 1000, reportCycle: 1000, desired: {{value: "exclusive_process"}}}}
"""
SETTER_GROUPS = ("power_limit", "locked_gpu_clocks", "locked_memory_clocks", "persistence_mode", "compute_mode")


def _run_with_desired_state(tmp_path: Path, as_user: int | None) -> MapperSnapshot:
    uuid0 = SimNvml(1, "H100", seed=0).gpus[0].uuid
    # A place the other user can reach (pytest's tmp_path lies under a 0700 directory of this user).
    base = Path(tempfile.mkdtemp(prefix="gpu-mapper-nonroot-"))
    base.chmod(0o755)
    devices = base / "devices"
    devices.mkdir()
    (devices / "gpu0.yaml").write_text(DESIRED_DEVICE.format(uuid=uuid0))
    (devices / "gpu0.yaml").chmod(0o644)
    data = base / "data"
    data.mkdir()
    if as_user is not None:
        os.chown(data, as_user, as_user)
    argv = ["--sim", "1", "--devices", str(devices), "--data-dir", str(data), "--node-name", "edge-1"]
    mapper = MapperProcess(argv, tmp_path / f"mapper-{as_user}.log", run_as=as_user)
    try:

        def settled() -> MapperSnapshot | None:
            snap = mapper.status()
            gpu = snap.gpus[0]
            done = gpu.desired_status and all(f"{g}:" in gpu.desired_status for g in SETTER_GROUPS)
            return snap if done and "pending" not in gpu.desired_status else None

        snap: MapperSnapshot = mapper.wait(settled, "every desired group settled")
    finally:
        assert mapper.stop() == 0, mapper.log()[-3000:]
        subprocess.run(["rm", "-rf", str(base)], check=False, timeout=30)
    return snap


@pytest.mark.timeout(90)
def test_as_a_non_root_user_reads_work_and_every_setter_is_rejected_no_permission(tmp_path: Path) -> None:
    # As root, the mapper is started as nobody; under any other user it already is not root.
    as_user = NOBODY if os.geteuid() == 0 else None
    snap = _run_with_desired_state(tmp_path, as_user)
    gpu = snap.gpus[0]
    # Reads work: the GPU's values are sampled.
    assert gpu.value("power_usage") is not None and gpu.value("temperature") is not None
    assert gpu.device == "default/gpu0"
    # Every setter was refused by NVML as for any non-root caller, and the twin says so.
    statuses = dict(part.split(":", 1) for part in gpu.desired_status.split(","))
    assert statuses == {g: "rejected-no-permission" for g in SETTER_GROUPS}, gpu.desired_status


@pytest.mark.timeout(60)
def test_under_the_mappers_umask_the_dmi_socket_is_still_0660_and_the_data_directory_0700(tmp_path: Path) -> None:
    data, sock = tmp_path / "data", tmp_path / "kubeedge" / "gpu.sock"
    argv = ["--sim", "1", "--node-name", "edge-1", "--data-dir", str(data), "--socket", str(sock)]
    argv += ["--edgecore-socket", str(tmp_path / "kubeedge" / "dmi.sock")]  # no EdgeCore: it keeps retrying
    mapper = MapperProcess(argv, tmp_path / "dmi.log")
    try:
        mapper.wait(lambda: sock.exists() and mapper.healthy(), "the mapper's DMI socket")
        assert mode(sock) == 0o660
        assert mode(data) == 0o700
        # Files 0600; a folder (the simulator's host tree, sim-host) 0700.
        private = {p.name: oct(mode(p)) for p in data.iterdir()}
        assert all(mode(p) == (0o700 if p.is_dir() else 0o600) for p in data.iterdir()), private
    finally:
        assert mapper.stop() == 0, mapper.log()[-3000:]
