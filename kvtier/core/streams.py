"""Copy streams and fences: where device <-> host copies run, and how others wait for them.

On a CUDA device each direction of copies gets a stream of its own (:class:`CopyStream`),
so a load or a backup runs beside the model's kernels instead of in line with them. A
:class:`Fence` is a point in a stream (a CUDA event): the model's stream waits for one
without the host waiting (:meth:`Fence.order`), a worker thread waits on the host
(:meth:`Fence.synchronize`) before it hands host pages on. Off CUDA a copy runs on the
calling thread and is over when the call returns, so every fence has already passed and
each of these calls costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["PASSED", "CopyStream", "Fence", "current_fence", "is_cuda"]


def is_cuda(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA device (the one kind with streams here)."""
    return torch.device(device).type == "cuda"


class Fence:
    """A point in a stream: passed once every copy queued before it has ended.

    ``event`` is a ``torch.cuda.Event`` recorded on the stream, or None for work that
    already ended (a copy off CUDA).
    """

    __slots__ = ("_event",)

    def __init__(self, event: Any = None) -> None:
        self._event = event

    @property
    def passed(self) -> bool:
        """Whether the work before the fence has ended (never blocks)."""
        return self._event is None or bool(self._event.query())

    def synchronize(self) -> None:
        """Block the calling thread until the fence has passed (a worker's wait, never the
        model's)."""
        if self._event is not None:
            self._event.synchronize()

    def order(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the caller's current stream) wait for the fence.

        The host does not wait: kernels queued on ``stream`` after this call start once
        the fence has passed.
        """
        if self._event is None:
            return
        target = torch.cuda.current_stream() if stream is None else stream
        target.wait_event(self._event)

    def __repr__(self) -> str:
        return f"Fence({'cuda event' if self._event is not None else 'passed'})"


#: The fence of work that already ended.
PASSED = Fence()


def current_fence(device: torch.device | str) -> Fence:
    """A fence after everything queued so far on ``device``'s current stream (the caller's).

    The caller's thread decides what "current" is: record it on the model's thread, then
    hand it to a worker, so the worker's copy waits for the kernels that wrote the data.
    """
    if not is_cuda(device):
        return PASSED
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(torch.device(device)))
    return Fence(event)


class CopyStream:
    """A stream for one direction of copies on ``device``, or the calling thread off CUDA."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._stream: Any = None
        if is_cuda(self.device):
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    @property
    def stream(self) -> Any:
        """The ``torch.cuda.Stream`` (None off CUDA)."""
        return self._stream

    @contextmanager
    def active(self, after: Fence | None = None) -> Iterator[None]:
        """Queue the copies made inside the block on this stream, after ``after``."""
        if self._stream is None:
            yield
            return
        if after is not None:
            after.order(self._stream)
        with torch.cuda.stream(self._stream):
            yield

    def fence(self) -> Fence:
        """A fence after everything queued on this stream so far."""
        if self._stream is None:
            return PASSED
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return Fence(event)

    def __repr__(self) -> str:
        return f"CopyStream({self.device})"
