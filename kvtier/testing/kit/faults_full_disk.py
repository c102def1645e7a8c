"""A full disk or a failing device at every step of a put (ENOSPC, EIO).

Where the backend writes through Python's ``os`` module, a dry run counts the ``os``
calls one put makes (:class:`~kvtier.testing.faults.OSFaults`: open, pwritev, fsync,
rename, fallocate...), then one put per step fails at that step, with ENOSPC and with
EIO. A backend whose writes are compiled code or a network client (Mooncake, the file
backend's compiled page loop) makes no such calls, or only some: the fault then comes at
the backend's boundary instead (:class:`~kvtier.testing.faults.FaultyBackend`: the call
raises, or each page in turn fails), and the test says which it used in its failure
messages. After each fault clears:

- a page reported True is served, whole;
- a page served is one of its own versions, never torn (checked by a fresh instance
  too); a fresh key whose put reported False is not served, unless only a sync call
  failed (the bytes were published and only their durability is in doubt): a put's
  results are true page by page;
- the store keeps working: the failed keys and new ones are put and served.
"""

from __future__ import annotations

import errno
from typing import ClassVar

import pytest

from kvtier.core.pagestore import PageStore
from kvtier.core.specs import Feature
from kvtier.testing.faults import FaultyBackend, OSFaults
from kvtier.testing.kit.faults_ledger import Ledger, fsync_modes, reopen_with, settle, views
from kvtier.testing.kit.harness import Harness, KitEnv

__all__ = ["FullDiskTests"]

#: Pages per faulted put.
_PAGES = 3
#: The calls whose failure leaves published bytes whose durability alone is in doubt.
_SYNC_CALLS = frozenset({"fsync", "fdatasync"})
_ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}


class FullDiskTests:
    """ENOSPC and EIO at every step of a put: False page by page, nothing torn, recovery."""

    #: Most steps of one put faulted (spread evenly over the put's steps beyond it).
    fault_steps: ClassVar[int] = 24

    @pytest.mark.parametrize("error", sorted(_ERRNOS))
    def test_kit_put_fails_at_every_os_step(self, kit: KitEnv, error: str) -> None:
        for n, mode in enumerate(fsync_modes(kit)):  # a durable mode has steps of its own
            env = kit if mode is None else reopen_with(kit, fsync=mode)
            label = f"{error}, fsync={mode!r}"
            try:
                # one store for every mode: each mode's harness makes keys of its own
                if not self._every_os_step(env, _ERRNOS[error], label, seed=n):
                    return  # the backend makes no os write call: faulted at its boundary
            finally:
                if env is not kit:
                    env.close_all()

    def _every_os_step(self, env: KitEnv, code: int, label: str, *, seed: int) -> bool:
        """Fail each step of one put in turn; False if a put makes no ``os`` write call
        (the faults then went to the backend's boundary instead)."""
        h = env.open(num_pages=4 * _PAGES, seed=seed)
        ledger = Ledger()
        pages = h.pool.allocate(_PAGES)
        with OSFaults() as dry:
            h.fill(pages, seed=900)
            assert ledger.put(h, h.keys(_PAGES), pages) == [True] * _PAGES
            settle(h)
        steps = len(dry.calls)
        if not steps:  # compiled or networked I/O: fault the backend's boundary
            _boundary_faults(h, ledger, code)
            _recovers(env, h, ledger)
            return False
        count = min(steps, self.fault_steps)
        tried = sorted({1 + (i * steps) // count for i in range(count)})
        fired = 0
        for n, step in enumerate(tried):
            keys = h.keys(_PAGES)
            h.fill(pages, seed=1000 + n)
            with OSFaults(fail_at=step, errno=code) as fault:
                results = ledger.put(h, keys, pages)
                settle(h)
            if fault.failed is None:
                continue
            fired += 1
            where = f"{label}: {fault.failed} failed (step {step} of {dry.calls})"
            strict = fault.failed not in _SYNC_CALLS
            _after_fault(h, ledger, keys, results, where=where, strict=strict)
        assert fired, f"{label}: no step failed; the dry run's steps {dry.calls} never came again"
        _recovers(env, h, ledger)
        return True

    def test_kit_put_fails_at_every_page_at_the_boundary(self, kit: KitEnv) -> None:
        h = kit.open(num_pages=4 * _PAGES)
        ledger = Ledger()
        _boundary_faults(h, ledger, errno.ENOSPC)
        _recovers(kit, h, ledger)


def _boundary_faults(h: Harness, ledger: Ledger, code: int) -> None:
    """Faults at the backend's boundary: the whole call raises, then each page in turn
    fails (the pages before it stored, as a disk that fills mid-batch leaves them)."""
    pages = h.pool.allocate(_PAGES)
    raising = FaultyBackend(h.backend, error_rate=1.0)
    store = PageStore(raising, h.pool, fingerprint=h.geometry.fingerprint, owns_backend=False)
    keys = h.keys(_PAGES)
    h.fill(pages, seed=1100)
    ledger.offered(keys, h.payloads(pages))
    try:
        assert list(store.put(keys, pages)) == [False] * _PAGES
    finally:
        store.close()  # its own call thread; the backend stays the harness's
    _after_fault(h, ledger, keys, [False] * _PAGES, where=f"errno {code}: put raised", strict=True)
    for failing in range(_PAGES):
        keys = h.keys(_PAGES)
        h.fill(pages, seed=1200 + failing)
        payloads = h.payloads(pages)
        ledger.offered(keys, payloads)
        stored = list(h.store.put(keys[:failing], pages[:failing])) if failing else []
        results = stored + [False] * (_PAGES - failing)
        ledger.acknowledge(keys, payloads, results)
        _after_fault(h, ledger, keys, results, where=f"errno {code} at page {failing}", strict=True)
    h.pool.free(pages)


def _after_fault(
    h: Harness,
    ledger: Ledger,
    keys: list[str],
    results: list[bool],
    *,
    where: str,
    strict: bool,
) -> None:
    """What a put that met a fault left: acknowledged pages whole, nothing torn, and (when
    ``strict``) no page served whose put reported False."""
    scratch = h.pool.allocate(_PAGES)
    try:
        acked = [k for k, ok in zip(keys, results, strict=True) if ok]
        for name, store in views(h):
            must = acked if name == "store" else ()
            ledger.check(h, store, keys, scratch, where=f"{where}, {name}", must_hold=must)
        if strict:
            h.scribble(scratch)
            served = list(h.store.get(keys, scratch))
            wrong = [k for k, ok, s in zip(keys, results, served, strict=True) if s and not ok]
            assert not wrong, (
                f"{where}: the put reported False for {len(wrong)} page(s) that are stored "
                f"and served ({wrong}); a put's results must be true page by page"
            )
        torn = {
            k: v
            for k, v in h.store.stats().items()
            if k.startswith("invalid_") and k != "invalid_bad_magic" and v
        }
        assert not torn, f"{where}: a reader met torn or foreign pages: {torn}"
    finally:
        h.pool.free(scratch)


def _recovers(kit: KitEnv, h: Harness, ledger: Ledger) -> None:
    """After the faults: failed keys and new ones are put and served, here and by a fresh
    instance (which also finds every acknowledged page, when the backend persists)."""
    pages = h.pool.allocate(_PAGES)
    failed = [k for k in ledger.versions if k not in ledger.acked][:_PAGES]
    for keys in (failed, h.keys(_PAGES)):
        if not keys:
            continue
        h.fill(pages[: len(keys)], seed=1300)
        expected = h.payloads(pages[: len(keys)])
        assert ledger.put(h, keys, pages[: len(keys)]) == [True] * len(keys), (
            "the store does not take puts after the fault cleared"
        )
        h.scribble(pages)
        assert list(h.store.get(keys, pages[: len(keys)])) == [True] * len(keys)
        assert h.payloads(pages[: len(keys)]) == expected
    settle(h)
    fresh = kit.open(num_pages=_PAGES)
    keep = Feature.PERSISTENT in kit.spec.features
    ledger.check(
        fresh,
        fresh.store,
        list(ledger.versions),
        fresh.pool.allocate(_PAGES),
        where="a fresh instance after the faults",
        must_hold=[k for k in ledger.acked if keep],
    )
