"""docs/operations.md "Running the image": podman, docker, nerdctl and ctr lines that say the same thing, and the
podman one is what ``tests/test_image.py`` runs (it reads its flags from there, so they cannot drift apart)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from mapper.cli import build_parser
from tests.imagedocs import OPERATIONS, documented_data_mount, documented_limits, documented_runs, podman_line
from tests.test_image import Image, Runner, documented_args, host_capped_limits

REPO = Path(__file__).resolve().parent.parent


def _tag() -> str:
    out = subprocess.run(
        [str(REPO / "scripts" / "build-image.sh"), "--print-tag"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_doc_shows_a_run_line_for_podman_docker_nerdctl_and_ctr_of_the_built_image() -> None:
    runs = documented_runs()
    assert sorted(runs) == ["ctr", "docker", "nerdctl", "podman"]
    tag = _tag()
    assert {r.image for r in runs.values()} == {tag}
    podman = runs["podman"]
    # docker and nerdctl take the same flags and arguments as podman.
    for runtime in ("docker", "nerdctl"):
        assert runs[runtime].flags == podman.flags and runs[runtime].args == podman.args, runtime
    flags = set(podman.flags)
    assert {"--rm", "--network=host", "--read-only", "--tmpfs=/tmp"} <= flags
    assert [f.split("=")[1] for f in documented_limits()] == ["nofile", "nproc"]
    src, dst = documented_data_mount()
    assert dst == "/var/lib/gpu-mapper"
    # ctr: the same network, data directory and arguments; it names the entrypoint itself.
    ctr = runs["ctr"]
    assert "--net-host" in ctr.flags and "--rm" in ctr.flags
    assert f"--mount=type=bind,src={src},dst={dst},options=rbind:rw" in ctr.flags
    container_id, entrypoint, *ctr_args = ctr.args
    assert entrypoint == "/usr/local/bin/gpu-mapper" and tuple(ctr_args) == podman.args
    assert re.fullmatch(r"[a-z][a-z0-9-]+", container_id)
    # The arguments are the mapper's: they parse.
    assert podman.args[:3] == ("run", "--sim", "2")
    build_parser().parse_args(list(podman.args))
    # Every archive a line loads is the one scripts/build-image.sh writes.
    text = OPERATIONS.read_text()
    section = text[text.index("### Running the image") :].split("\n## ", 1)[0]
    version = re.search(r'^version = "(.*)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]
    assert set(re.findall(r"dist/[\w.-]+\.oci\.tar", section)) == {f"dist/gpu-mapper-{version}.oci.tar"}
    # The caveat: the error a user meets, and the flags that avoid it.
    assert "error setting rlimit type 7: operation not permitted" in section
    assert " ".join(documented_limits()) in section


def test_the_image_test_runs_the_documented_podman_line(tmp_path: Path) -> None:
    image = Image(_tag(), tmp_path / "a.oci.tar", 0, 0, tmp_path / "rootfs", {"config": {}})
    runner = Runner(image, tmp_path)
    limits = host_capped_limits(documented_limits())
    runner.podman = Runner.podman_prefix(["podman"], "runc", limits)
    src, dst = documented_data_mount()
    argv = runner.argv("c", {Path(src): dst}, {}, documented_args("127.0.0.1:9410"))
    line = podman_line()
    at = argv.index(image.tag)
    assert argv[:2] == ["podman", "run"]
    assert tuple(argv[at + 1 :]) == line.args, "the documented arguments, the metrics address as documented"
    # Every documented flag, the limits as documented unless this host's own are lower.
    ran = set(argv[2:at])
    assert set(line.flags) - set(documented_limits()) <= ran
    assert limits == [f for f in argv if f.startswith("--ulimit")]
    for documented, used in zip(documented_limits(), limits, strict=True):
        kind, values = documented.removeprefix("--ulimit=").split("=")
        used_kind, used_values = used.removeprefix("--ulimit=").split("=")
        assert used_kind == kind
        assert all(int(u) <= int(d) for u, d in zip(used_values.split(":"), values.split(":"), strict=True))
