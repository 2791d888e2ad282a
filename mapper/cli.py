"""Command line: ``gpu-mapper run | discover | model | decode | status | buffer | bridge``.

argv + environment + config file -> Settings; logging; ``asyncio.run(app.run(settings))``.

Each command imports what it runs when it runs: ``gpu-mapper bridge`` loads no ``mapper.edge`` module and
``gpu-mapper run`` no ``mapper.bridge`` module (``tests/test_sides.py``). Building the parser imports neither
side: the help texts name the environment variables by the rule of ``mapper.shared.settings``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mapper import __version__
from mapper.errors import ConfigError, MapperError
from mapper.shared.settings import BRIDGE_ENV_PREFIX, MAPPER_ENV_PREFIX, env_variable, read_config_file

if TYPE_CHECKING:
    from mapper.edge.config import Settings

log = logging.getLogger("mapper")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus any ``extra`` fields."""

    _skip = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._skip:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _env(name: str) -> str:
    """The mapper's variable of setting ``name`` (``mapper.edge.config.ENV_KEYS``'s value)."""
    return env_variable(MAPPER_ENV_PREFIX, name)


class _CommandParser(argparse.ArgumentParser):
    """The parser of one command (and of its own sub-commands): an argument it does not know is its own error,
    with its own usage, not the top-level parser's (which argparse would otherwise report)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error("unrecognized arguments: " + " ".join(extras))
        return parsed, extras


class _TopParser(argparse.ArgumentParser):
    """``gpu-mapper``: a command's flag given before any command (``gpu-mapper --sim 2``) is answered with the
    command that takes it (``did you mean 'gpu-mapper run --sim 2'?``)."""

    commands: dict[str, argparse.ArgumentParser]

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
            flag = argv[0].split("=", 1)[0]
            owners = [name for name, p in self.commands.items() if flag in p._option_string_actions]
            if owners:
                shown = " ".join(argv)
                self.error(
                    f"{flag} is a flag of a command, not of gpu-mapper itself: did you mean "
                    f"'gpu-mapper {owners[0]} {shown}'?"
                    + (f" ({flag} is also a flag of: {', '.join(owners[1:])})" if owners[1:] else "")
                )
        return super().parse_known_args(argv, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = _TopParser(
        prog="gpu-mapper",
        description="KubeEdge device mapper that makes every GPU of this edge node a KubeEdge Device.",
    )
    parser.add_argument("--version", action="version", version=f"gpu-mapper {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)

    run = sub.add_parser(
        "run",
        help="run the mapper",
        description="Run the mapper. Each flag overrides its GPU_MAPPER_* environment variable, "
        "which overrides the config file.",
    )
    _add_sim_flags(run)
    run.add_argument("--node-name", help=f"this edge node's name (env {_env('node_name')}; default: hostname)")
    run.add_argument(
        "--edgecore-socket",
        help=f"EdgeCore's DMI socket (env {_env('edgecore_socket')}; default /etc/kubeedge/dmi.sock)",
    )
    run.add_argument(
        "--socket", help=f"this mapper's own DMI socket (env {_env('socket')}; default /etc/kubeedge/gpu.sock)"
    )
    run.add_argument(
        "--mqtt",
        dest="mqtt_url",
        metavar="URL",
        help=f"MQTT broker, mqtt://host:port or mqtts://host:port for TLS (env {_env('mqtt_url')}); "
        "without it telemetry is buffered until one is configured",
    )
    run.add_argument("--mqtt-username", help=f"MQTT user name (env {_env('mqtt_username')})")
    run.add_argument(
        "--mqtt-password",
        help=f"MQTT password (env {_env('mqtt_password')}); prefer --mqtt-password-file: other local users see "
        "command lines",
    )
    run.add_argument(
        "--mqtt-password-file",
        metavar="FILE",
        help=f"read the MQTT password from FILE, e.g. a mounted Secret (env {_env('mqtt_password_file')})",
    )
    run.add_argument("--mqtt-ca-file", help=f"CA bundle for mqtts:// (env {_env('mqtt_ca_file')})")
    run.add_argument("--mqtt-cert-file", help=f"client certificate for mqtts:// (env {_env('mqtt_cert_file')})")
    run.add_argument("--mqtt-key-file", help=f"client key for mqtts:// (env {_env('mqtt_key_file')})")
    run.add_argument(
        "--mqtt-key-password-file",
        metavar="FILE",
        help=f"read the passphrase of an encrypted --mqtt-key-file from FILE (env {_env('mqtt_key_password_file')})",
    )
    run.add_argument(
        "--mqtt-eventbus",
        choices=["auto", "true", "false"],
        help="publish KubeEdge EventBus twin/state updates; auto = only without DMI (standalone mode)",
    )
    run.add_argument(
        "--data-dir", help=f"SQLite buffer and desired state (env {_env('data_dir')}; default /var/lib/gpu-mapper)"
    )
    run.add_argument(
        "--devices",
        dest="devices_dir",
        metavar="DIR",
        help=f"standalone mode: load Device/DeviceModel YAML from DIR instead of EdgeCore (env {_env('devices_dir')})",
    )
    run.add_argument("--config", metavar="FILE", help="YAML config file (the ConfigMap); env GPU_MAPPER_CONFIG")
    run.add_argument(
        "--metrics-addr",
        metavar="HOST:PORT",
        help=f"/metrics, /healthz, /readyz and /status (env {_env('metrics_addr')}; default 0.0.0.0:9410)",
    )
    run.add_argument(
        "--web-config-file",
        metavar="FILE",
        help="TLS and basic auth for the HTTP endpoints, in Prometheus exporter-toolkit format "
        f"(env {_env('web_config_file')}; default: off, plain HTTP)",
    )
    run.add_argument("--log-format", choices=["text", "json"], help=f"log format (env {_env('log_format')})")
    run.add_argument("--log-level", help=f"log level, e.g. INFO or DEBUG (env {_env('log_level')})")
    run.add_argument(
        "--print-interval",
        dest="print_interval_s",
        type=float,
        metavar="SECONDS",
        help="print a live per-GPU table every SECONDS (default: 2 with --sim, off otherwise)",
    )

    disc = sub.add_parser("discover", help="print Device YAML for every GPU of this node")
    _add_sim_flags(disc)
    disc.add_argument("--node-name", help="node name used in Device names and nodeName (default: hostname)")
    disc.add_argument("--namespace", default="default", help="Device namespace (default: default)")
    disc.add_argument("--model", help="DeviceModel name (default: the GPU family's, nvidia-gpu or nvidia-jetson)")

    sub.add_parser("model", help="print every GPU DeviceModel (nvidia-gpu, nvidia-jetson) generated from the catalog")

    dec = sub.add_parser("decode", help="turn telemetry batches into JSON lines")
    dec.add_argument("file", nargs="?", default="-", help="a file of batches, or - for standard input")

    from mapper.tools.buffer import add_parser as add_buffer_parser

    add_buffer_parser(sub)

    st = sub.add_parser("status", help="show this node's GPUs and the buffer backlog")
    st.add_argument("--url", help="the running mapper's HTTP address (default http://127.0.0.1:9410)")
    st.add_argument("--data-dir", help="read the last snapshot from the data directory instead")
    st.add_argument("--json", action="store_true", help="print the raw JSON snapshot")
    st.add_argument(
        "--wide", action="store_true", help="every column in full (UUIDs, desired status, health reasons), any width"
    )
    _add_bridge_parser(sub)
    parser.commands = dict(sub.choices)
    return parser


#: ``gpu-mapper bridge`` flags: (flag, settings name, metavar, help). Each has a GPU_MAPPER_BRIDGE_* variable.
_BRIDGE_FLAGS: tuple[tuple[str, str, str, str], ...] = (
    ("--mqtt", "mqtt_url", "URL", "the cloud-side broker, mqtt://host:port or mqtts://host:port"),
    ("--mqtt-username", "mqtt_username", "NAME", "MQTT user name"),
    ("--mqtt-password", "mqtt_password", "PASSWORD", "MQTT password; prefer --mqtt-password-file"),
    ("--mqtt-password-file", "mqtt_password_file", "FILE", "read the MQTT password from FILE (a mounted Secret)"),
    ("--mqtt-ca-file", "mqtt_ca_file", "FILE", "CA bundle for mqtts://"),
    ("--mqtt-cert-file", "mqtt_cert_file", "FILE", "client certificate for mqtts://"),
    ("--mqtt-key-file", "mqtt_key_file", "FILE", "client key for mqtts://"),
    ("--mqtt-key-password-file", "mqtt_key_password_file", "FILE", "passphrase of an encrypted --mqtt-key-file"),
    ("--mqtt-client-id", "mqtt_client_id", "ID", "MQTT client id (default <group>-<hostname>[-N]: one per process)"),
    ("--mqtt-session-expiry", "mqtt_session_expiry_s", "DURATION", "how long the broker keeps the session (1h)"),
    ("--mqtt-receive-maximum", "mqtt_receive_maximum", "N", "unacknowledged messages the broker may send (1000)"),
    ("--mqtt-reconnect-max-backoff", "mqtt_reconnect_max_s", "DURATION", "longest wait between reconnects (30s)"),
    ("--topic", "topic", "FILTER", "telemetry topic filter (default gpu-mapper/+/+/+/telemetry)"),
    ("--state-topic", "state_topic", "FILTER", "retained state messages (default: --topic with .../state)"),
    ("--node-topic", "node_topic", "FILTER", "the mappers' own series (default: gpu-mapper/+/metrics beside --topic)"),
    ("--group", "group", "NAME", "shared-subscription group of the replicas (default gpu-mapper-bridge)"),
    ("--remote-write", "remote_write", "URL", "remote-write endpoint, e.g. http://prometheus:9090/api/v1/write"),
    ("--remote-write-version", "remote_write_version", "1|2", "remote write 1.0 (default) or 2.0 with fallback"),
    ("--remote-write-username", "remote_write_username", "NAME", "basic auth user for the receiver"),
    ("--remote-write-password", "remote_write_password", "PASSWORD", "basic auth password; prefer ...-password-file"),
    ("--remote-write-password-file", "remote_write_password_file", "FILE", "read the basic auth password from FILE"),
    ("--remote-write-bearer-token-file", "remote_write_bearer_token_file", "FILE", "bearer token for the receiver"),
    ("--remote-write-ca-file", "remote_write_ca_file", "FILE", "CA bundle for an https:// receiver"),
    ("--remote-write-timeout", "remote_write_timeout_s", "DURATION", "timeout of one request (30s)"),
    ("--batch-max-samples", "batch_max_samples", "N", "samples per request at most (10000)"),
    ("--batch-max-delay", "batch_max_delay_s", "DURATION", "longest wait before a request goes out (1s)"),
    ("--retry-min-backoff", "retry_min_s", "DURATION", "first retry delay after a 5xx, 429 or network error"),
    ("--retry-max-backoff", "retry_max_s", "DURATION", "longest retry delay"),
    ("--uuid-wait", "uuid_wait_s", "DURATION", "how long a batch without a known GPU uuid waits for one (5s)"),
    ("--metrics-addr", "metrics_addr", "HOST:PORT", "/metrics /healthz /readyz (default 0.0.0.0:9411)"),
    ("--spool-dir", "spool_dir", "DIR", "where refused requests are kept"),
    ("--log-format", "log_format", "text|json", "log format"),
    ("--log-level", "log_level", "LEVEL", "log level, e.g. INFO or DEBUG"),
)


def _add_bridge_parser(sub: Any) -> None:
    br = sub.add_parser(
        "bridge",
        help="cloud side: the MQTT telemetry stream into Prometheus remote write",
        description="Read telemetry batches from the broker (MQTT 5 shared subscription, persistent session) and "
        "write them by Prometheus remote write. Each flag overrides its GPU_MAPPER_BRIDGE_* variable, which "
        "overrides the bridge: section of the config file. 'gpu-mapper bridge export' prints the spool of "
        "refused requests as OpenMetrics text for promtool tsdb create-blocks-from openmetrics.",
    )
    br.add_argument("action", nargs="?", choices=["run", "export"], default="run", help="run (default) or export")
    br.add_argument(
        "--config", metavar="FILE", help="YAML config file (its bridge: section); env GPU_MAPPER_BRIDGE_CONFIG"
    )
    br.add_argument("--output", "-o", metavar="FILE", help="export: write here instead of standard output")
    for flag, name, metavar, text in _BRIDGE_FLAGS:
        env = env_variable(BRIDGE_ENV_PREFIX, name)  # mapper.bridge.config.BRIDGE_ENV_KEYS's value
        br.add_argument(flag, dest="bridge_" + name, metavar=metavar, help=f"{text} (env {env})")


def _add_sim_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sim", type=int, metavar="N", help="use N simulated GPUs instead of the real NVML")
    p.add_argument(
        "--sim-profile",
        help="simulated GPU profile: H100, H200, A100, A10, L4, L40S or T4 (NVML); orin-agx, xavier-agx, "
        "orin-nano, orin-agx-jp7 or thor (a Jetson: a simulated sysfs tree under the data directory, and a "
        "simulated NVML beside it for the JetPack 7 ones)",
    )
    p.add_argument("--sim-seed", type=int, help="simulator seed (UUIDs and noise derive from it)")
    p.add_argument("--sim-scenario", help="simulated workload: idle, steady, inference, training, heat, oscillating")
    p.add_argument(
        "--sim-cost",
        choices=["none", "h200"],
        help="what each simulated NVML call costs: none (default: free) or h200 (the CPU and waits measured per call "
        "on an H200, as benchmarks use)",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "nvml", "jetson"],
        help="GPU library: auto (default: a Jetson where a Tegra GPU is found, its sysfs and nvpmodel with NVML for "
        "what it serves there; else NVML), nvml or jetson",
    )
    p.add_argument("--jetson-root", help="Jetson: the root sysfs and /proc are read under (default /)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    from mapper.edge.config import load_settings

    flags = {k: v for k, v in vars(args).items() if k != "command"}
    if flags.get("sim") and flags.get("print_interval_s") is None and sys.stdout.isatty():
        flags["print_interval_s"] = 2.0
    return load_settings(flags.get("config"), flags=flags)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "discover":
            return _discover(args)
        if args.command == "model":
            from mapper.tools.discover import all_models_yaml

            sys.stdout.write(all_models_yaml())
            return 0
        if args.command == "decode":
            from mapper.wire.telemetry import decode_command

            try:
                return decode_command(args.file, sys.stdin.buffer, sys.stdout)
            except BrokenPipeError:
                # The reader went away (``gpu-mapper decode f | head``): not an error.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
        if args.command == "status":
            return _status(args)
        if args.command == "buffer":
            from mapper.tools import buffer as buffertool

            return buffertool.main(args)
        if args.command == "bridge":
            return _bridge(args)
    except ConfigError as exc:
        print(f"gpu-mapper: configuration error: {exc}", file=sys.stderr)
        return 2
    except MapperError as exc:
        print(f"gpu-mapper: {exc}", file=sys.stderr)
        return 1
    return 2


#: Threads of the default executor (``asyncio.to_thread``). NVML calls have their own thread, so only start-up,
#: the status file, devices-folder reads and MQTT (re)connects (each bounded by its connect timeout) use it, and
#: two threads keep those going. Python's default, ``min(32, cores + 4)``, leaves start-up's burst of threads
#: idle for the whole run, each with its own stack and possibly its own glibc malloc arena.
DEFAULT_EXECUTOR_WORKERS = 2


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (modules, classes, config, the app's long-lived state) to
    the garbage collector's permanent generation; the number of objects frozen.

    The collector's full (generation 2) passes otherwise walk all of them again and again: measured in the running
    mapper, one pass every ~45 s cost ~12 ms, about a tenth of its whole CPU. Objects made later are collected as
    usual; frozen ones are never freed by the cycle collector (reference counting still frees them)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def warn_secrets_on_command_line(flags: Mapping[str, Any], secret_flags: Mapping[str, str]) -> None:
    """A warning for each secret given as a flag (``secret_flags``: its name -> the flag that reads it from a
    file): on the command line it is visible to every local user in the process list."""
    for name, file_name in secret_flags.items():
        if flags.get(name) is not None:
            log.warning(
                "%s on the command line is visible to every local user in the process list; use %s "
                "(or its environment variable) instead",
                "--" + name.replace("_", "-"),
                "--" + file_name.replace("_", "-"),
            )


def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    setup_logging(settings.log_format, settings.log_level)
    # Every file the mapper creates (SQLite files and their journals, status.json) is private to its user; the
    # DMI socket is chmod-ed 0660 after it is made. mapper.edge.storage.datadir tightens what an earlier run left wider.
    os.umask(0o077)
    from mapper.edge.config import SECRET_FLAGS

    warn_secrets_on_command_line(vars(args), SECRET_FLAGS)
    from mapper.edge.app import run

    async def main_task() -> int:
        loop = asyncio.get_running_loop()
        # asyncio.run shuts the default executor down (and joins its threads) when main_task returns.
        loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(max_workers=DEFAULT_EXECUTOR_WORKERS, thread_name_prefix="mapper-io")
        )
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def started() -> None:
            log.info("garbage collector: %d start-up objects frozen", freeze_startup_heap())

        return await run(settings, stop, on_started=started)

    try:
        return asyncio.run(main_task())
    except KeyboardInterrupt:
        return 130


def _discover(args: argparse.Namespace) -> int:
    from mapper.edge.app import build_backend
    from mapper.edge.config import load_settings
    from mapper.tools.discover import device_yaml, probe_all

    settings = load_settings(None, flags={k: v for k, v in vars(args).items() if k not in ("command",)})
    from mapper.edge.gpu.tegra import TegraBackend

    backend = build_backend(settings, one_shot=True)
    try:
        gpus = backend.list_gpus()
        # A Jetson's: where each property comes from (sysfs, nvpmodel, NVML) and why; what nothing serves.
        sources = {g.uuid: backend.property_sources(g.uuid) for g in gpus} if isinstance(backend, TegraBackend) else {}
        unsupported = probe_all(
            backend, gpus, sources
        )  # each property read once per GPU: what it cannot read is left out
    finally:
        backend.shutdown()
    text = device_yaml(
        gpus,
        settings.node_name,
        namespace=args.namespace,
        model=args.model,
        unsupported=unsupported,
        sources=sources,
    )
    sys.stdout.write(text)
    return 0


def _status(args: argparse.Namespace) -> int:
    from mapper.edge.status.metrics import read_status

    snapshot = read_status(url=args.url, data_dir=args.data_dir)
    if args.json:
        print(snapshot.to_json())
    else:
        from mapper.edge.status.view import render_status

        print(render_status(snapshot, wide=args.wide), end="")
    return 0


def _bridge(args: argparse.Namespace) -> int:
    from mapper.bridge.config import BRIDGE_SECRET_FLAGS, load_bridge_settings

    flags = {k[len("bridge_") :]: v for k, v in vars(args).items() if k.startswith("bridge_")}
    if args.action == "export":
        from mapper.bridge.app import export_openmetrics
        from mapper.bridge.config import BridgeSettings

        spool_dir = flags.get("spool_dir")
        if spool_dir is None:
            cfg = args.config or os.environ.get("GPU_MAPPER_BRIDGE_CONFIG")
            env_dir = os.environ.get("GPU_MAPPER_BRIDGE_SPOOL_DIR")
            spool_dir = env_dir or (_spool_dir_of(cfg) if cfg else None) or BridgeSettings().spool_dir
        if args.output:
            with open(args.output, "w", encoding="utf-8") as out:
                n = export_openmetrics(spool_dir, out)
        else:
            n = export_openmetrics(spool_dir, sys.stdout)
        print(f"gpu-mapper bridge export: {n} spool file(s) from {spool_dir}", file=sys.stderr)
        return 0
    settings = load_bridge_settings(args.config, flags=flags)
    setup_logging(settings.log_format, settings.log_level)
    warn_secrets_on_command_line(flags, BRIDGE_SECRET_FLAGS)
    from mapper.bridge.app import Bridge

    async def main_task() -> int:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(max_workers=DEFAULT_EXECUTOR_WORKERS, thread_name_prefix="bridge-io")
        )
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await Bridge(settings).run(stop)

    try:
        return asyncio.run(main_task())
    except KeyboardInterrupt:
        return 130


def _spool_dir_of(config_file: str) -> str | None:
    section = read_config_file(config_file).get("bridge") or {}
    value = section.get("spoolDir") if isinstance(section, dict) else None
    return str(value) if value else None


if __name__ == "__main__":
    raise SystemExit(main())
