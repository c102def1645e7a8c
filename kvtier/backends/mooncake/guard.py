"""Whether the Mooncake master answers: a TCP probe of its port and the guard built on it.

With the master gone each Mooncake call takes seconds of internal retries; after the first
RPC_FAIL the guard fails calls at once and probes the port again at most every interval.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

__all__ = ["MasterGuard", "reachable"]


def reachable(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class MasterGuard:
    """Whether the master answers. After an RPC_FAIL calls fail at once until it is back.

    ``log`` is the backend's logger, so the recovery message keeps the name operators
    filter on.
    """

    def __init__(
        self, host: str, port: int, probe_timeout: float, interval: float, log: logging.Logger
    ) -> None:
        self.host, self.port = host, port
        self.probe_timeout = probe_timeout
        self.interval = interval
        self.down = False
        self._last_probe = 0.0
        self._lock = threading.Lock()
        self._log = log

    def allow(self) -> bool:
        """True if a call may go to Mooncake now; probes a down master at most per interval."""
        with self._lock:
            if not self.down:
                return True
            now = time.monotonic()
            if now - self._last_probe < self.interval:
                return False
            self._last_probe = now
        if reachable(self.host, self.port, self.probe_timeout):
            with self._lock:
                if self.down:
                    self._log.info("Mooncake master %s:%d accepts connections again", *self.addr)
                self.down = False
            return True
        return False

    @property
    def addr(self) -> tuple[str, int]:
        return self.host, self.port

    def trip(self) -> bool:
        """Mark the master down; True if it was up (the caller logs once per outage)."""
        with self._lock:
            was_up = not self.down
            self.down = True
            self._last_probe = time.monotonic()
            return was_up
