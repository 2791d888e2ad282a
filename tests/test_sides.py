"""The edge/cloud line: each process loads only its own side.

``gpu-mapper bridge`` (the cloud side) must load no ``mapper.edge`` module: none of the collect loop, the
reconciler, the policies or NVML comes with it. ``gpu-mapper run`` (the mapper on every edge node) must load no
``mapper.bridge`` module and no ``cramjam`` (the bridge's snappy), which would cost every node memory for
nothing. Each probe runs the real entry point (``mapper.cli.main``) in a fresh interpreter, until its HTTP
server answers, then stops it with SIGTERM and lists what was imported: start-up and the first requests load
what they import lazily too.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.brokers import free_port
from tests.test_lazy_imports import run_child

#: Watches ``url`` from a thread until it answers 200, then sends SIGTERM to this process. Shared head of the
#: two children below; argv[1] is the tmp dir, argv[2] the HTTP port, argv[3] the (silent) broker port.
WATCH = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time, urllib.request
    from pathlib import Path

    tmp, http_port, broker_port = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    seen = {}

    def watch(path, ready=lambda: True):
        url = "http://127.0.0.1:" + http_port + path
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    if resp.status == 200 and ready():
                        seen["answered"] = True
                        break
            except OSError:
                pass
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    def loaded(prefix):
        return sorted(m for m in sys.modules if m == prefix or m.startswith(prefix + "."))
    """
)

BRIDGE_CHILD = WATCH + textwrap.dedent(
    """
    from mapper.cli import main

    (tmp / "spool").mkdir()
    export = main(["bridge", "export", "--spool-dir", str(tmp / "spool"), "-o", str(tmp / "spool.om")])
    threading.Thread(target=watch, args=("/metrics",), daemon=True).start()
    code = main([
        "bridge", "--mqtt", "mqtt://127.0.0.1:" + broker_port, "--remote-write", "http://127.0.0.1:9/api/v1/write",
        "--metrics-addr", "127.0.0.1:" + http_port, "--spool-dir", str(tmp / "spool"),
    ])
    import mapper.bridge.app  # the module the command runs, whatever the CLI imported
    print(json.dumps({"exit_code": code or export, "answered": seen.get("answered", False),
                      "edge": loaded("mapper.edge"), "bridge": loaded("mapper.bridge")}))
    """
)

MAPPER_CHILD = WATCH + textwrap.dedent(
    """
    from mapper.cli import main

    (tmp / "devices").mkdir()
    status_file = tmp / "data" / "status.json"
    threading.Thread(target=watch, args=("/metrics", status_file.exists), daemon=True).start()
    code = main([
        "run", "--sim", "2", "--node-name", "edge-1", "--devices", str(tmp / "devices"),
        "--data-dir", str(tmp / "data"), "--metrics-addr", "127.0.0.1:" + http_port,
        "--mqtt", "mqtt://127.0.0.1:" + broker_port,
    ])
    import mapper.edge.app  # the module the command runs, whatever the CLI imported
    print(json.dumps({"exit_code": code, "answered": seen.get("answered", False),
                      "bridge": loaded("mapper.bridge"), "cramjam": loaded("cramjam"), "edge": loaded("mapper.edge")}))
    """
)


def test_gpu_mapper_bridge_loads_no_edge_module(tmp_path: Path) -> None:
    result = run_child(BRIDGE_CHILD, [str(tmp_path), str(free_port()), str(free_port())], tmp_path)
    assert result["answered"], "the bridge's /metrics never answered: the probe did not run the bridge"
    assert "mapper.bridge.app" in result["bridge"]
    assert result["edge"] == [], f"gpu-mapper bridge loaded {result['edge']}"


def test_gpu_mapper_run_loads_no_bridge_module_and_no_cramjam(tmp_path: Path) -> None:
    result = run_child(MAPPER_CHILD, [str(tmp_path), str(free_port()), str(free_port())], tmp_path)
    assert result["answered"], "the mapper's /metrics never answered with its status file written"
    assert "mapper.edge.app" in result["edge"]
    assert result["bridge"] == [], f"gpu-mapper run loaded {result['bridge']}"
    assert result["cramjam"] == [], "gpu-mapper run loaded cramjam"
