"""Where the supervisor's metrics go: an HTTP endpoint for Prometheus and/or a textfile for
node_exporter's textfile collector (``spotrun run --metrics-port`` / ``--metrics-textfile``).

A thread reads the workers' save measurements every :data:`REFRESH_INTERVAL_S` seconds, so
that every save is counted even when nobody scrapes. The address, port and textfile rules:
``docs/design/internals.md`` (Supervisor and control channel).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from prometheus_client import start_http_server, write_to_textfile

from spotrun.errors import ConfigError
from spotrun.supervisor.metrics import SupervisorMetrics

log = logging.getLogger(__name__)

#: Default of ``--metrics-address``: every interface (what a Prometheus scraping pods needs).
DEFAULT_ADDRESS = "0.0.0.0"
#: Seconds between two writes of the textfile besides those after events (node_exporter
#: itself is scraped every 15 to 60 s).
TEXTFILE_INTERVAL_S = 15.0
#: Seconds between two reads of the workers' save measurements.
REFRESH_INTERVAL_S = 1.0


class MetricsExporter:
    """An observer that feeds :class:`SupervisorMetrics` and exports them; outputs open at once.

    Args:
        metrics: the metrics to export (a new :class:`SupervisorMetrics` by default).
        port: serve over HTTP on this TCP port (0: any free one); ``None``: no endpoint.
        address: the address the endpoint listens on.
        textfile: write the metrics to this file (must end in ``.prom``); ``None``: none.
        textfile_interval_s: seconds between two periodic writes of ``textfile``.
        refresh_interval_s: seconds between two reads of the workers' measurements.

    Raises:
        ConfigError: the port cannot be bound (in use, bad address), or the textfile cannot
            be written (no such directory, not ``.prom``, no permission); nothing is left open.
    """

    def __init__(
        self,
        metrics: SupervisorMetrics | None = None,
        *,
        port: int | None = None,
        address: str = DEFAULT_ADDRESS,
        textfile: str | None = None,
        textfile_interval_s: float = TEXTFILE_INTERVAL_S,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
    ) -> None:
        self.metrics = metrics or SupervisorMetrics()
        self.textfile = textfile
        self._write_lock = threading.Lock()  # a periodic write never lands after the last one
        self._write_failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server = None
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(f"--metrics-port must be 0..65535, got {port}")
        if textfile is not None:
            if not textfile.endswith(".prom"):
                raise ConfigError(
                    f"--metrics-textfile {textfile!r} must end in .prom (node_exporter's "
                    "textfile collector reads only *.prom files)"
                )
            try:
                write_to_textfile(textfile, self.metrics.registry)
            except OSError as exc:
                raise ConfigError(f"cannot write --metrics-textfile {textfile}: {exc.strerror or exc}") from exc
        if port is not None:
            try:
                self._server, _ = start_http_server(port, addr=address, registry=self.metrics.registry)
            except OSError as exc:
                raise ConfigError(f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}") from exc
            log.info("metrics: http://%s:%d/metrics", address, self.port)
        if textfile is not None:
            log.info("metrics: written to %s every %.0f s and at each event", textfile, textfile_interval_s)
        self._thread = threading.Thread(
            target=self._refresh_every,
            args=(refresh_interval_s, textfile_interval_s),
            name="spotrun-metrics",
            daemon=True,
        )
        self._thread.start()

    @property
    def port(self) -> int | None:
        """The TCP port of the endpoint (the one chosen for port 0); ``None`` without one."""
        return None if self._server is None else self._server.server_port

    def event(self, name: str, fields: dict[str, Any]) -> None:
        self.metrics.event(name, fields)
        self._write()

    def close(self) -> None:
        """Write the textfile a last time and stop the endpoint. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._write()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _refresh_every(self, refresh_interval_s: float, textfile_interval_s: float) -> None:
        written_s = time.monotonic()
        while not self._stop.wait(refresh_interval_s):
            try:
                self.metrics.refresh()
            except Exception as exc:  # never end the thread (nor print a traceback into the log)
                log.warning("metrics: reading the workers' measurements failed: %s", exc)
            if time.monotonic() - written_s >= textfile_interval_s:
                self._write()
                written_s = time.monotonic()

    def _write(self) -> None:
        if self.textfile is None:
            return
        with self._write_lock:
            try:
                write_to_textfile(self.textfile, self.metrics.registry)
            except OSError as exc:  # the supervision goes on; say it once
                if not self._write_failed:
                    log.warning("cannot write the metrics to %s: %s (trying again at each event)", self.textfile, exc)
                self._write_failed = True


def metrics_observers(port: int | None, address: str | None, textfile: str | None) -> list[MetricsExporter]:
    """The observer for ``spotrun run``'s metrics options: one exporter, or none when neither
    ``port`` nor ``textfile`` is given.

    Raises:
        ConfigError: as :class:`MetricsExporter`.
    """
    if port is None and textfile is None:
        return []
    return [
        MetricsExporter(
            port=port, address=address or DEFAULT_ADDRESS, textfile=os.path.abspath(textfile) if textfile else None
        )
    ]
