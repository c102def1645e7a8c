"""Kill mid-write (``persistent`` and ``shared_processes``): a writer SIGKILLed mid-put.

A child process opens the backend on the same store and puts, batch after batch, new
versions of pages this process stored before it started and of pages never stored; this
process reads them while it writes, then kills it with SIGKILL at a moment that differs
from round to round (the child spends nearly all its time inside ``put``, so the kill
lands mid-write). Every read, during the writes and after the kill, by the store opened
before the child and by one opened after the kill, finds for each key a version some
writer put whole (the old page or a new one) or a miss: never a torn page. The envelope
would turn a torn page into a counted ``invalid`` miss, so the test also fails when a
read was rejected for anything but a missing envelope magic (see :func:`_torn`): a page
that looks whole must be whole. The store then keeps serving every key.

:func:`_child_writes` is the child's side; it must stay importable from this module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import ClassVar

from kvtier.core.specs import Feature
from kvtier.testing.kit.children import child_job, open_child, read_job
from kvtier.testing.kit.harness import Harness, KitEnv, require_feature

__all__ = ["KillMidWriteTests"]

#: Pages per put: the first half stored by this process first, the second half new.
_KEYS = 8
#: Versions the child cycles through, each a seed of its own.
_VERSIONS = 3
_OLD_SEED = 300
_NEW_SEED = 400
#: How long the child may write before it gives up (if this process died first).
_CHILD_LIMIT_S = 60.0


class KillMidWriteTests:
    """``persistent`` + ``shared_processes``: a writer killed mid-put tears no page."""

    #: Kills per test, each after a different time of writing.
    kill_rounds: ClassVar[int] = 3

    def test_kit_writer_killed_mid_put_leaves_whole_pages_or_misses(self, kit: KitEnv) -> None:
        require_feature(kit, Feature.PERSISTENT)
        require_feature(kit, Feature.SHARED_PROCESSES)
        h = kit.open(num_pages=3 * _KEYS)
        keys = h.keys(_KEYS)
        old, out = h.pool.allocate(_KEYS), h.pool.allocate(_KEYS)
        half = _KEYS // 2
        h.fill(old[:half], seed=_OLD_SEED)
        assert h.store.put(keys[:half], old[:half]) == [True] * half
        # what each key may hold: any version some writer put whole
        allowed: dict[str, set[bytes]] = {key: set() for key in keys}
        for key, payload in zip(keys[:half], h.payloads(old[:half]), strict=True):
            allowed[key].add(payload)
        for version in range(_VERSIONS):
            h.fill(old, seed=_NEW_SEED + version)
            for key, payload in zip(keys, h.payloads(old), strict=True):
                allowed[key].add(payload)
        job = child_job(kit, h, keys=keys, seeds=[_NEW_SEED + v for v in range(_VERSIONS)])
        seen = 0
        for round_ in range(self.kill_rounds):
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from kvtier.testing.kit.kill_mid_write import _child_writes; _child_writes()",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "error"},
            )
            try:
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(json.dumps(job))
                child.stdin.close()
                if child.stdout.readline().strip() != "writing":
                    child.kill()
                    raise AssertionError(
                        f"the writer process did not start writing:\n{_stderr(child)}"
                    )
                # read while it writes, for a while that differs from round to round
                until = time.monotonic() + 0.02 + 0.06 * round_
                while time.monotonic() < until:
                    seen += _check(h, keys, out, allowed)
                child.send_signal(signal.SIGKILL)
                child.wait(timeout=60)
                err = _stderr(child)
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait(timeout=60)
                for stream in (child.stdout, child.stderr):
                    if stream is not None:
                        stream.close()
            assert child.returncode == -signal.SIGKILL, (
                f"the writer exited by itself ({child.returncode}) before it was killed:\n{err}"
            )
            after = kit.open(num_pages=_KEYS)  # a store opened after the writer died
            seen += _check(h, keys, out, allowed) + _check(
                after, keys, after.pool.allocate(_KEYS), allowed
            )
            for store in (h, after):
                torn = _torn(store.store.stats())
                assert not torn, (
                    f"a reader found torn pages after a writer was killed mid-put: {torn}"
                )
        assert seen, "no read found any page: the test checked nothing"
        # the store keeps serving: every key takes a new page and gives it back
        h.fill(old, seed=_OLD_SEED + 1)
        expected = h.payloads(old)
        assert h.store.put(keys, old) == [True] * _KEYS
        h.scribble(out)
        assert h.store.get(keys, out) == [True] * _KEYS
        assert h.payloads(out) == expected


def _torn(stats: dict[str, int | float]) -> dict[str, int | float]:
    """The envelope rejections that mean a torn page reached a reader.

    A page with no envelope magic (``invalid_bad_magic``) is one a writer made
    unreadable on purpose before rewriting it in place (the ``file`` backend's compiled
    loop clears the magic first and writes the header last), so a writer killed half-way
    leaves a page every reader refuses: a miss, as a missing page is. Every other
    rejection (a payload checksum, a length, a torn header, another key's bytes) is a
    page that looked whole and was not.
    """
    return {
        name: value
        for name, value in stats.items()
        if name.startswith("invalid_") and name != "invalid_bad_magic" and value
    }


def _stderr(child: subprocess.Popen[str]) -> str:
    """What a dead child wrote on stderr."""
    child.wait(timeout=60)
    return child.stderr.read() if child.stderr is not None else ""


def _check(h: Harness, keys: list[str], out: list[int], allowed: dict[str, set[bytes]]) -> int:
    """Read every key; each hit must be a version some writer put whole. Returns the hits."""
    h.scribble(out)
    found = h.store.get(keys, out)
    hits = 0
    for key, ok, payload in zip(keys, found, h.payloads(out), strict=True):
        if ok:
            hits += 1
            assert payload in allowed[key], f"page {key} holds bytes no writer put whole"
    return hits


def _child_writes() -> None:
    """Child side of :class:`KillMidWriteTests`: put every version in turn until killed.

    The versions are filled in first, so the loop is nothing but puts.
    """
    job = read_job()
    keys, seeds = job["keys"], job["seeds"]
    env, h = open_child(job, num_pages=len(keys) * len(seeds))
    versions = []
    for seed in seeds:
        pages = h.pool.allocate(len(keys))
        h.fill(pages, seed=seed)
        versions.append(pages)
    deadline = time.monotonic() + _CHILD_LIMIT_S
    announced = False
    while time.monotonic() < deadline:
        for pages in versions:
            results = h.store.put(keys, pages)
            if results != [True] * len(keys):
                env.close_all()
                raise SystemExit(f"child put failed: {results}")
            if not announced:  # one put is whole: from now on it is always mid-write
                print("writing", flush=True)
                announced = True
    env.close_all()
    raise SystemExit(f"not killed within {_CHILD_LIMIT_S} s")
