"""SIGKILL with puts in flight, under every ``fsync`` mode the backend declares.

A child process opens the backend with one ``fsync`` mode and puts fresh pages from
several threads at once; as each put returns it reports the keys acknowledged (one line
each, flushed). Once enough are acknowledged this process kills it with SIGKILL, while
other puts are still in flight, then opens the store afresh (a restart) and checks every
key the child could have put, byte for byte: each acknowledged page is there and exact
(a process crash is what every mode promises to survive; a backend whose weakest mode
does not promise it lists the modes that do in ``crash_safe_fsync``), no page holds
bytes it was not given whole, and the store keeps working. ``persistent`` and
``shared_processes`` are needed (a restart must find the pages, and two processes open
one store). :func:`_child_puts` is the child's side and must stay importable from here.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, ClassVar

import pytest

from kvtier.core.specs import Feature
from kvtier.testing.faults import OSFaults
from kvtier.testing.kit.children import child_job, open_child, read_job
from kvtier.testing.kit.faults_ledger import Ledger, fsync_modes, reopen_with, views
from kvtier.testing.kit.harness import Harness, KitEnv, require_feature

__all__ = ["KillInFlightTests"]

#: Writer threads in the child, keys each, pages per put.
_THREADS = 3
_KEYS = 24
_BATCH = 2
_SEED = 2000
#: How long the child may write, and this process wait for it.
_CHILD_LIMIT_S = 60.0
#: No acknowledgement for this long once a write call is held: the other writers wait
#: behind it (a lock), so kill now.
_QUIET_S = 1.0
_CHILD = "from kvtier.testing.kit.faults_kill import _child_puts; _child_puts()"


class KillInFlightTests:
    """``persistent`` + ``shared_processes``: a kill -9 mid-put loses no acknowledged page."""

    #: Modes whose acknowledged puts must survive a process kill (None: every declared one).
    crash_safe_fsync: ClassVar[frozenset[str] | None] = None
    #: Acknowledged pages to wait for before the kill.
    kill_after_acks: ClassVar[int] = 8
    #: Keys each writer thread of the child puts (raise it, with ``kill_after_acks``, for
    #: a store that must fill past its capacity before the kill).
    kill_keys: ClassVar[int] = _KEYS
    #: Kills per ``fsync`` mode: the first lands wherever the writers are; each further
    #: one while the child holds one ``os`` write call of a put (a later one each round),
    #: so a put is surely mid-write while the others go on (backends that write through
    #: ``os``; for the others each round is one more kill at a moment of its own).
    kill_rounds: ClassVar[int] = 2

    def test_kit_kill_with_puts_in_flight_loses_no_acknowledged_page(self, kit: KitEnv) -> None:
        require_feature(kit, Feature.PERSISTENT)
        require_feature(kit, Feature.SHARED_PROCESSES)
        ledger = Ledger()  # one for every round: each round's keys are its own
        for n, mode in enumerate(fsync_modes(kit)):
            env = kit if mode is None else reopen_with(kit, fsync=mode)
            try:
                for round_ in range(self.kill_rounds):
                    hold = 0 if round_ == 0 else 2 + 3 * round_ + n
                    self._kill_round(env, ledger, mode, 10 * n + round_, hold)
            finally:
                if env is not kit:
                    env.close_all()
        assert ledger.acked, "the writer never acknowledged a put: the test checked nothing"

    def _kill_round(self, env: KitEnv, ledger: Ledger, mode: str | None, n: int, hold: int) -> None:
        h = env.open(num_pages=2 * _BATCH, seed=100 + n)
        keys = [h.keys(self.kill_keys) for _ in range(_THREADS)]
        job = child_job(env, h, keys=keys, seed=_SEED, hold=hold)
        job.update(getattr(env, "child_extra", dict)())
        acked, err = _run_and_kill(job, self.kill_after_acks + n % 10)
        where = f"fsync={mode!r}, kill {n % 10 + 1}" + (
            f" (write call {hold} held)" if hold else ""
        )
        pages = h.pool.allocate(1)
        acked_before = set(ledger.acked)
        for t, thread_keys in enumerate(keys):
            for i, key in enumerate(thread_keys):
                h.fill(pages, seed=_SEED + 1000 * t + i)
                ledger.offered([key], h.payloads(pages))
                if key in acked:
                    ledger.acknowledge([key], h.payloads(pages), [True])
        safe = self.crash_safe_fsync
        must = [k for k in ledger.acked if k not in acked_before]
        must = must if safe is None or mode in safe else []
        every = [k for thread_keys in keys for k in thread_keys]
        after = env.open(num_pages=2 * _BATCH, seed=200 + n)  # a restart: opened after the kill
        scratch = after.pool.allocate(_BATCH)
        for name, store in views(after):
            held = must if name == "store" else ()
            at = f"{where}, after the kill, {name}"
            ledger.check(after, store, every, scratch, where=at, must_hold=held)
        ledger.check(h, h.store, every, pages, where=f"{where}, the instance opened before")
        torn = {
            k: v
            for k, v in after.store.stats().items()
            if k.startswith("invalid_") and k != "invalid_bad_magic" and v
        }
        assert not torn, f"{where}: pages torn by the kill looked whole: {torn}\n{err}"
        _keeps_working(after, ledger, scratch)


def _run_and_kill(job: dict[str, Any], acks: int) -> tuple[set[str], str]:
    """Start the writer, kill it once ``acks`` pages are acknowledged (or once none came for
    a while: its writers may all wait behind a held call); the acknowledged keys it
    reported, and what it wrote on stderr."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    acked: set[str] = set()
    lines: queue.Queue[str | None] = queue.Queue()

    def read(stream: IO[str]) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps(job))
        child.stdin.close()
        reader = threading.Thread(target=read, args=(child.stdout,), daemon=True)
        reader.start()
        deadline = time.monotonic() + _CHILD_LIMIT_S
        held = False
        while len(acked) < acks and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=_QUIET_S if held else _CHILD_LIMIT_S)
            except queue.Empty:
                break  # a write is held and nothing else is acknowledged: kill it now
            if line is None:
                break
            kind, _, key = line.strip().partition(" ")
            held = held or kind == "held"
            if kind == "ack":
                acked.add(key)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=_CHILD_LIMIT_S)
        reader.join(_CHILD_LIMIT_S)
        while not lines.empty():  # reported before it died
            line = lines.get()
            kind, _, key = (line or "").strip().partition(" ")
            if kind == "ack" and key:
                acked.add(key)
        err = child.stderr.read() if child.stderr is not None else ""
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=_CHILD_LIMIT_S)
        for stream in (child.stdout, child.stderr):
            if stream is not None:
                stream.close()
    if child.returncode != -signal.SIGKILL:
        pytest.fail(f"the writer ended by itself ({child.returncode}) before the kill:\n{err}")
    return acked, err


def _keeps_working(h: Harness, ledger: Ledger, pages: list[int]) -> None:
    keys = h.keys(len(pages))
    h.fill(pages, seed=_SEED - 1)
    expected = h.payloads(pages)
    assert ledger.put(h, keys, pages) == [True] * len(pages), "no put succeeds after the kill"
    h.scribble(pages)
    assert list(h.store.get(keys, pages)) == [True] * len(pages)
    assert h.payloads(pages) == expected


def _child_puts() -> None:
    """Child side: ``_THREADS`` threads put their keys ``_BATCH`` at a time, each page filled
    from its own seed; each acknowledged key is reported on stdout as it returns."""
    job = read_job()
    opener = job.get("opener")
    if opener:
        module, _, name = opener.partition(":")
        open_chain = getattr(importlib.import_module(module), name)
        env, h = open_chain(job, num_pages=_THREADS * _BATCH)
    else:
        env, h = open_child(job, num_pages=_THREADS * _BATCH)
    out = threading.Lock()
    if job["hold"]:  # hold one write call of some put until the kill
        hold = OSFaults(fail_at=job["hold"], stall_s=_CHILD_LIMIT_S).__enter__()

        def report_hold() -> None:
            if hold.reached.wait(_CHILD_LIMIT_S):
                with out:
                    print("held", flush=True)

        threading.Thread(target=report_hold, daemon=True).start()
    deadline = time.monotonic() + _CHILD_LIMIT_S

    def writer(t: int, keys: list[str], pages: list[int]) -> None:
        for start in range(0, len(keys), _BATCH):
            batch = keys[start : start + _BATCH]
            for j, page in enumerate(pages[: len(batch)]):
                h.fill([page], seed=job["seed"] + 1000 * t + start + j)
            results = h.store.put(batch, pages[: len(batch)])
            with out:
                for key, ok in zip(batch, results, strict=True):
                    if ok:
                        sys.stdout.write(f"ack {key}\n")
                sys.stdout.flush()

    threads = [
        threading.Thread(target=writer, args=(t, keys, h.pool.allocate(_BATCH)), daemon=True)
        for t, keys in enumerate(job["keys"])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    time.sleep(max(0.0, deadline - time.monotonic()))  # all written: wait to be killed
    env.close_all()
    raise SystemExit(f"not killed within {_CHILD_LIMIT_S} s")
