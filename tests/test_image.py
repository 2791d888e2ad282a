"""The container image: ``scripts/build-image.sh`` builds it here (Debian packages and PyPI wheels only), and the
image's entrypoint runs ``gpu-mapper run --sim 2``: /healthz answers and telemetry batches reach a real mosquitto.

The image runs under podman when podman can run containers on this machine (the runtime that works is
used: crun, else runc), with the flags of the podman line docs/operations.md shows ("Running the image",
``tests/imagedocs.py`` reads it): its ``--ulimit`` flags are added where the runtime's defaults exceed what the
host allows (capped to the host's own limits where even they are higher). Where no
container can run (a cgroup v1 or hybrid host that neither runtime accepts), its root filesystem, unpacked from
the OCI archive, runs under ``unshare`` (new mount and PID namespaces) and ``chroot``. The test prints which it
did, and the image's size.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import queue
import re
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as paho
import pytest
import yaml

from mapper.wire.dictionaries import DICTIONARY_SHA256
from mapper.wire.telemetry import decode_batch
from tests.brokers import Mosquitto, free_port
from tests.imagedocs import documented_container_flags, documented_data_mount, documented_limits, podman_line

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass(frozen=True)
class Image:
    tag: str
    archive: Path
    unpacked_bytes: int
    archive_bytes: int
    rootfs: Path
    config: dict  # type: ignore[type-arg]


def _unpack_oci_archive(archive: Path, dest: Path) -> dict:  # type: ignore[type-arg]
    """The image's root filesystem (its layers in order) into ``dest``; returns the image config."""
    with tarfile.open(archive) as outer:

        def blob(digest: str) -> bytes:
            member = outer.extractfile("blobs/" + digest.replace(":", "/"))
            assert member is not None, digest
            return member.read()

        index = json.loads(outer.extractfile("index.json").read())  # type: ignore[union-attr]
        manifest = json.loads(blob(index["manifests"][0]["digest"]))
        config = json.loads(blob(manifest["config"]["digest"]))
        for layer in manifest["layers"]:
            data = blob(layer["digest"])
            if layer["mediaType"].endswith("gzip"):
                data = gzip.decompress(data)
            with tarfile.open(fileobj=io.BytesIO(data)) as inner:
                inner.extractall(dest, filter="fully_trusted", numeric_owner=True)
    return config


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    out = tmp_path_factory.mktemp("image")
    started = time.monotonic()
    proc = subprocess.run(
        [str(REPO / "scripts" / "build-image.sh"), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=840,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1].split()
    assert last[0] == "image", proc.stdout
    tag, archive, unpacked, packed = last[1], Path(last[2]), int(last[3]), int(last[4])
    rootfs = out / "rootfs"
    rootfs.mkdir()
    config = _unpack_oci_archive(archive, rootfs)
    print(
        f"\nimage {tag}: built in {time.monotonic() - started:.0f} s; {unpacked / 1e6:.1f} MB unpacked, "
        f"{packed / 1e6:.1f} MB as an OCI archive ({archive.name})"
    )
    yield Image(tag, archive, unpacked, packed, rootfs, config)
    shutil.rmtree(out, ignore_errors=True)


def test_the_image_is_tagged_as_the_daemonset_and_the_readme_name_it(image: Image) -> None:
    docs = list(yaml.safe_load_all((REPO / "deploy" / "daemonset.yaml").read_text()))
    containers = docs[0]["spec"]["template"]["spec"]["containers"]
    assert containers[0]["image"] == image.tag
    assert image.tag in (REPO / "README.md").read_text()
    printed = subprocess.run(
        [str(REPO / "scripts" / "build-image.sh"), "--print-tag"], capture_output=True, text=True, timeout=30
    )
    assert printed.stdout.strip() == image.tag


def test_the_image_has_the_entrypoint_the_labels_and_no_build_or_test_tools(image: Image) -> None:
    cfg = image.config["config"]
    assert cfg["Entrypoint"] == ["/usr/local/bin/gpu-mapper"] and cfg["Cmd"] == ["run"]
    assert "9410/tcp" in cfg.get("ExposedPorts", {})
    labels = cfg["Labels"]
    for key in ("title", "version", "revision", "created", "licenses", "source", "description"):
        assert labels.get(f"org.opencontainers.image.{key}"), key
    assert labels["org.opencontainers.image.version"] == re.search(
        r'^version = "(.*)"', (REPO / "pyproject.toml").read_text(), re.M
    ).group(1)  # type: ignore[union-attr]
    root = image.rootfs
    site = root / "usr/local/lib/python3.11/dist-packages"
    assert (site / "mapper" / "cli.py").exists() and (site / "mapper" / "py.typed").exists()
    # The telemetry batches' zstd dictionaries, package data with the bytes their hashes in the code name.
    for dict_id, digest in DICTIONARY_SHA256.items():
        shipped = site / "mapper" / "wire" / "dicts" / f"{dict_id}.zdict"
        assert hashlib.sha256(shipped.read_bytes()).hexdigest() == digest, shipped
    for name in ("paho", "grpc", "zstandard", "prometheus_client", "yaml", "bcrypt", "pynvml.py"):
        assert (site / name).exists(), name
    # Nothing to compile, build or test with, and not the tests themselves.
    for tool in ("gcc", "cc", "c++", "make", "ld", "as", "pip", "pip3", "pytest", "git"):
        for d in ("usr/bin", "usr/local/bin", "usr/sbin"):
            assert not (root / d / tool).exists(), f"{d}/{tool} is in the image"
    for package in ("pytest", "mypy", "ruff", "hypothesis", "grpc_tools", "tests", "setuptools", "pip"):
        assert not (site / package).exists(), package
    # No compiler's libraries, and not all of perl (perl-base, which dpkg needs, stays).
    assert not list(root.glob("usr/lib/gcc*")) and not (root / "usr/share/perl").exists()
    assert oct((root / "var/lib/gpu-mapper").stat().st_mode & 0o777) == "0o700"


# --------------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------------


class Runner:
    """How this machine runs the image: ``argv(name, mounts, env, args)`` gives the command line."""

    def __init__(self, image: Image, work: Path) -> None:
        self.image = image
        self.work = work
        self.how = ""
        self.podman: list[str] = []
        self.store: Path | None = None

    def choose(self) -> str:
        podman = shutil.which("podman")
        # GPU_MAPPER_TEST_IMAGE_RUNNER=chroot takes the fallback even where podman works (to check it).
        if os.environ.get("GPU_MAPPER_TEST_IMAGE_RUNNER") == "chroot":
            podman = None
        if podman is not None:
            # podman wants a short run root (50 characters at most): not under pytest's tmp_path.
            store = self.store = Path(tempfile.mkdtemp(prefix="gpm-podman-"))
            base = [podman, "--root", str(store / "root"), "--runroot", str(store / "run"),
                    "--storage-driver", "vfs", "--events-backend", "file"]  # fmt: skip
            loaded = subprocess.run([*base, "load", "-q", "-i", str(self.image.archive)],
                                    capture_output=True, text=True, timeout=300)  # fmt: skip
            assert loaded.returncode == 0, loaded.stderr
            limits = host_capped_limits(documented_limits())
            tried = []
            for runtime in ("crun", "runc"):
                if shutil.which(runtime) is None:
                    continue
                for extra, note in (([], ""), (limits, ", with the documented resource limits")):
                    prefix = self.podman_prefix(base, runtime, extra)
                    cmd = [*prefix, *documented_container_flags(), self.image.tag, "--version"]
                    probe = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                    if probe.returncode == 0 and "gpu-mapper" in probe.stdout:
                        self.podman = prefix
                        self.how = f"podman (runtime {runtime}{note}: {' '.join(extra) or 'its own limits'})"
                        return self.how
                    tried.append(f"{runtime}{note}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
            print("\npodman cannot run containers here: " + "; ".join(tried))
        self.how = "unshare (mount and PID namespaces) + chroot of the image's root filesystem"
        return self.how

    @staticmethod
    def podman_prefix(base: list[str], runtime: str, limits: list[str]) -> list[str]:
        """``podman run`` with this machine's storage (``base``), the runtime that works and the limits it needs."""
        return [*base, "run", f"--runtime={runtime}", *limits]

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM to the mapper: podman forwards it; unshare does not, so there it goes to unshare's child (the
        mapper, PID 1 of its namespace), whose exit status unshare then returns."""
        if proc.poll() is not None:
            return
        if self.podman:
            proc.terminate()
            return
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        if children:
            os.kill(int(children[0]), signal.SIGTERM)
        else:
            proc.terminate()

    def argv(self, name: str, mounts: dict[Path, str], env: dict[str, str], args: list[str]) -> list[str]:
        if self.podman:
            # The documented line's flags (--rm, --network=host, --read-only, --tmpfs=/tmp), its volume's target.
            cmd = [*self.podman, *documented_container_flags(), "--name", name]
            for src, dst in mounts.items():
                cmd.append(f"--volume={src}:{dst}")
            for key, value in env.items():
                cmd.append(f"--env={key}={value}")
            return [*cmd, self.image.tag, *args]
        root = self.image.rootfs
        for src, dst in mounts.items():
            target = root / dst.lstrip("/")
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(src, target)
        entry = self.image.config["config"]["Entrypoint"]
        image_env = dict(e.split("=", 1) for e in self.image.config["config"].get("Env", []))
        env_args = [f"{k}={v}" for k, v in {**image_env, **env}.items()]
        # --kill-child: should this test die, the mapper gets SIGTERM too.
        return ["unshare", "--mount", "--pid", "--fork", "--kill-child=SIGTERM", f"--mount-proc={root / 'proc'}",
                "chroot", str(root),
                "/usr/bin/env", "-i", *env_args, *entry, *args]  # fmt: skip


def host_capped_limits(limits: list[str]) -> list[str]:
    """The documented ``--ulimit=<type>=<soft>:<hard>`` flags, each capped to this process's own limits (which a
    container started by this user cannot exceed)."""
    kinds = {"nofile": resource.RLIMIT_NOFILE, "nproc": resource.RLIMIT_NPROC}
    out = []
    for flag in limits:
        kind, values = flag.removeprefix("--ulimit=").split("=", 1)
        soft, hard = (int(v) for v in values.split(":"))
        host_soft, host_hard = resource.getrlimit(kinds[kind])
        if host_soft != resource.RLIM_INFINITY:
            soft = min(soft, host_soft)
        if host_hard != resource.RLIM_INFINITY:
            hard = min(hard, host_hard)
        out.append(f"--ulimit={kind}={min(soft, hard)}:{hard}")
    return out


def documented_args(metrics_addr: str) -> list[str]:
    """The documented podman line's arguments after the image, with this test's metrics address."""
    args = list(podman_line().args)
    args[args.index("--metrics-addr") + 1] = metrics_addr
    return args


def _healthz(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_the_images_entrypoint_runs_the_mapper_which_answers_healthz_and_sends_batches_to_mosquitto(
    image: Image, tmp_path: Path
) -> None:
    runner = Runner(image, tmp_path)
    how = runner.choose()
    print(f"\nrunning the image with {how}")
    broker = Mosquitto(tmp_path)
    broker.start()
    batches: queue.Queue[tuple[str, bytes]] = queue.Queue()
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="image-test-listener")
    client.on_message = lambda c, u, m: batches.put((m.topic, bytes(m.payload)))
    client.connect("127.0.0.1", broker.port)
    client.subscribe("gpu-mapper/image-node/#", qos=1)
    client.loop_start()
    devices = tmp_path / "devices"
    devices.mkdir()
    port = free_port()
    name = f"gpu-mapper-test-{os.getpid()}"
    env = {"GPU_MAPPER_TELEMETRY_WINDOW_S": "1s", "GPU_MAPPER_LOG_LEVEL": "INFO"}
    mounts = {devices: "/etc/gpu-mapper/devices"}
    if runner.podman:
        data = tmp_path / "data"
        data.mkdir()
        mounts[data] = documented_data_mount()[1]  # the root filesystem is read-only, as in the DaemonSet
    # The documented line's arguments (run --sim 2 --node-name image-node --metrics-addr ...), on a free port, with
    # a devices folder and the broker.
    args = [*documented_args(f"127.0.0.1:{port}"), "--devices", "/etc/gpu-mapper/devices", "--mqtt", broker.url]
    log = (tmp_path / "mapper.log").open("wb")
    proc = subprocess.Popen(runner.argv(name, mounts, env, args), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthz(url):
            assert proc.poll() is None, (tmp_path / "mapper.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no /healthz in 120 s: " + (tmp_path / "mapper.log").read_text()[-3000:]
            time.sleep(0.2)
        uuids: set[str] = set()
        while len(uuids) < 2:
            remaining = deadline - time.monotonic()
            assert remaining > 0, (
                f"batches of {len(uuids)} GPU(s) only: " + (tmp_path / "mapper.log").read_text()[-3000:]
            )
            try:
                topic, payload = batches.get(timeout=remaining)
            except queue.Empty:
                continue
            if topic.endswith("/telemetry"):
                batch = decode_batch(payload)
                assert batch.samples and batch.samples[0].values
                uuids.add(batch.uuid)
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            assert 'gpu_mapper_gpus{node="image-node"} 2.0' in resp.read().decode()
        print(f"/healthz answered and batches of {len(uuids)} simulated GPUs reached mosquitto ({how}); image "
              f"{image.unpacked_bytes / 1e6:.1f} MB unpacked, {image.archive_bytes / 1e6:.1f} MB archive")  # fmt: skip
    finally:
        runner.stop(proc)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
        log.close()
        client.loop_stop()
        client.disconnect()
        broker.stop()
        if runner.podman:
            subprocess.run([*runner.podman[: runner.podman.index("run")], "rm", "-f", name],
                           capture_output=True, timeout=60)  # fmt: skip
        if runner.store is not None:
            shutil.rmtree(runner.store, ignore_errors=True)
    assert code == 0, (tmp_path / "mapper.log").read_text()[-3000:]
