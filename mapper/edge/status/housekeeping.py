"""The mapper's slow chores, one loop: the status file in the data directory (what ``gpu-mapper status
--data-dir`` reads while the mapper is down; ``/status`` is the live one) and the config file watched for
changes (its policies reloaded without a restart; a bad edit is refused and the previous policies stay).

It sees no adapter: writing the status file is a callable handed in (``mapper.edge.status.metrics.write_status_file``
bound to the data directory).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Mapping

from mapper.edge.control.policy import PolicyEngine, parse_policies
from mapper.edge.kubeedge.registry import ConfigErrors, ConfigProblem
from mapper.edge.status.stats import MapperSnapshot
from mapper.errors import ConfigError, MapperError
from mapper.shared.settings import read_config_file

log = logging.getLogger("mapper.edge.app")

#: How often the status file is written and the config file checked, by default. (Each round wakes the loop
#: and a thread; the status file is the offline fallback of ``gpu-mapper status``, /status is live.)
DEFAULT_INTERVAL_S = 10.0


class Housekeeping:
    """``snapshot``: the mapper's snapshot now. ``write_status``: stores one as the status file (raises
    ``OSError`` or ``MapperError``). ``config_file``: the file to watch, or "" for none. ``policies``: the
    engine whose config a changed file replaces; ``overrides``: the per-GPU policy overrides now (they stay).
    ``beat``: the loop's heartbeat (name, period s). ``config_errors``: where a refused edit is recorded (and
    forgotten once a valid one is loaded)."""

    def __init__(
        self,
        snapshot: Callable[[], MapperSnapshot],
        write_status: Callable[[MapperSnapshot], object],
        config_file: str | None,
        policies: PolicyEngine,
        overrides: Callable[[], Mapping[str, str]],
        beat: Callable[[str, float], None],
        interval_s: float = DEFAULT_INTERVAL_S,
        config_errors: ConfigErrors | None = None,
        retry_saves: Callable[[], object] | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.write_status = write_status
        self.config_file = config_file
        self.policies = policies
        self.overrides = overrides
        self.beat = beat
        self.interval_s = interval_s
        self.config_errors = config_errors if config_errors is not None else ConfigErrors()
        #: Called each round: the writes that failed on a full or read-only data dir tried again (the desired store).
        self.retry_saves = retry_saves
        #: Why the status file could not be written last time ("" when it was): logged once, not every round.
        self.status_error = ""
        #: The config file's mtime as last looked at (0.0: not yet).
        self.config_mtime = 0.0

    async def run(self) -> None:
        """The status file for ``gpu-mapper status --data-dir``, and config reloads (policies)."""
        while True:
            self.beat("housekeeping", self.interval_s)
            if self.retry_saves is not None:
                self.retry_saves()
            await self.write_status_file()
            self.maybe_reload_config()
            await asyncio.sleep(self.interval_s)

    async def write_status_file(self) -> None:
        """The snapshot written in a thread; a failure is logged, and the loop goes on."""
        try:
            await asyncio.to_thread(self.write_status, self.snapshot())
        except (OSError, MapperError) as exc:
            if not self.status_error:
                log.warning("could not write the status file (logged once until it works again): %s", exc)
            self.status_error = str(exc) or type(exc).__name__
            return
        if self.status_error:
            log.info("the status file is written again")
        self.status_error = ""

    def maybe_reload_config(self) -> None:
        path = self.config_file
        if not path:
            return
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return
        if self.config_mtime == 0.0:
            self.config_mtime = mtime
            return
        if mtime == self.config_mtime:
            return
        self.config_mtime = mtime
        try:
            data = read_config_file(path)
            config = parse_policies(data.get("policies") or {})
            self.policies.configure(config, dict(self.overrides()))
        except ConfigError as exc:
            log.error("config %s changed but was refused; the previous policies stay: %s", path, exc)
            self.config_errors.settle("config-file", (ConfigProblem("config-file", path, (), "invalid", str(exc)),))
            return
        self.config_errors.settle("config-file")
        log.info("config %s reloaded: policies %s", path, json.dumps(config.to_mapping()))
