"""The progress line every ``kvtier bench`` workload shows on stderr.

On a terminal it is a one-line bar redrawn in place (at most every 50 ms). Anywhere else
(a CI log, ``2> run.log``) a redrawn bar would be noise, and silence until the end looks
like a hang, so it writes plain lines instead: one when the work starts, at most one
every ``interval`` seconds while it runs, and one when it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO

__all__ = ["PLAIN_INTERVAL_S", "Progress"]

#: Seconds between two plain-text progress lines when stderr is not a terminal.
PLAIN_INTERVAL_S = 5.0
#: Seconds between two redraws of the bar on a terminal.
_BAR_INTERVAL_S = 0.05


class Progress:
    """A bar on a terminal, plain lines at a modest rate elsewhere; nothing when disabled."""

    def __init__(
        self,
        total: int,
        stream: IO[str],
        enabled: bool,
        *,
        title: str = "",
        unit: str = "",
        interval: float = PLAIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream
        self.enabled = enabled
        self.tty = enabled and stream.isatty()
        self.title = title
        self.unit = unit
        self.interval = interval
        self._clock = clock
        self._started = clock()
        self._last = self._started
        self._closed = False
        if enabled and not self.tty:
            self._line(f"started, {self.total}{self._unit()} to go")

    def _unit(self) -> str:
        return f" {self.unit}" if self.unit else ""

    def _line(self, text: str) -> None:
        name = " ".join(filter(None, ("kvtier bench", self.title.strip())))
        self.stream.write(f"{name}: {text}\n")
        self.stream.flush()

    def step(self, label: str, n: int = 1) -> None:
        """Count ``n`` more units done; redraw the bar, or write a line when one is due."""
        self.done = min(self.done + n, self.total)
        if not self.enabled:
            return
        now = self._clock()
        if not self.tty:
            if now - self._last >= self.interval and self.done < self.total:
                self._last = now
                percent = 100 * self.done // self.total
                self._line(
                    f"{self.done}/{self.total}{self._unit()} ({percent}%), {label}, "
                    f"{now - self._started:.0f} s"
                )
            return
        if now - self._last < _BAR_INTERVAL_S and self.done < self.total:
            return
        self._last = now
        width = 30
        filled = width * self.done // self.total
        bar = "#" * filled + "." * (width - filled)
        count = f" {self.done}/{self.total} {self.unit}" if self.unit else ""
        percent = 100 * self.done // self.total
        self.stream.write(f"\r{self.title}[{bar}]{count} {percent:3d}% {label:<28}")
        self.stream.flush()

    def close(self) -> None:
        """Clear the bar, or write the closing line (once)."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self.tty:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()
        else:
            elapsed = self._clock() - self._started
            self._line(f"finished, {self.done}/{self.total}{self._unit()} in {elapsed:.1f} s")
