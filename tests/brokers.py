"""A real mosquitto for tests: started on a free loopback port, stoppable and restartable on the same port."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
    if found is None:
        raise RuntimeError("mosquitto is not installed: scripts/test.sh installs it (apt-get install mosquitto)")
    return found


def password_file(folder: Path, users: dict[str, str]) -> Path:
    """``folder/passwd`` for mosquitto's ``password_file``, made by ``mosquitto_passwd`` for ``users`` (user ->
    password), 0600."""
    path = folder / "passwd"
    for i, (user, password) in enumerate(users.items()):
        args = ["mosquitto_passwd", "-b", str(path), user, password]
        if i == 0:
            args.insert(1, "-c")
        subprocess.run(args, check=True, capture_output=True, timeout=30)
    path.chmod(0o600)
    return path


class Mosquitto:
    """One broker process. ``stop()`` kills it; ``start()`` brings it back on the same port."""

    def __init__(self, workdir: Path, port: int | None = None, extra_config: str = "") -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.extra_config = extra_config
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"mosquitto-{self.port}.log"

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def config_text(self) -> str:
        """The broker's configuration file; a subclass changes what the broker keeps by overriding this."""
        return (
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            f"max_inflight_messages 100\nmax_queued_messages 100000\n{self.extra_config}\n"
        )

    def start(self, timeout_s: float = 10.0) -> None:
        conf = self.workdir / f"mosquitto-{self.port}.conf"
        conf.write_text(self.config_text())
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen([mosquitto_binary(), "-c", str(conf)], stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                return
            time.sleep(0.02)
        raise RuntimeError(f"mosquitto did not listen on {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
