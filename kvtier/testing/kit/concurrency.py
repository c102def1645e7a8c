"""Concurrency: puts and gets from several threads, no torn reads."""

from __future__ import annotations

import threading
from typing import ClassVar

from kvtier.testing.kit.harness import KitEnv

__all__ = ["ConcurrencyTests"]


class ConcurrencyTests:
    """Puts and gets from several threads at once: every page whole, no torn reads."""

    threads: ClassVar[int] = 6

    def test_kit_concurrent_puts(self, kit: KitEnv) -> None:
        h = kit.open(num_pages=4 * self.threads + self.threads)
        shared = h.keys(1)[0]
        work = [(h.keys(4), h.pool.allocate(4)) for _ in range(self.threads)]
        out = h.pool.allocate(self.threads)
        for i, (_keys, pages) in enumerate(work):
            h.fill(pages, seed=100 + i)
        expected = {
            k: h.payload(p) for keys, pages in work for k, p in zip(keys, pages, strict=True)
        }
        candidates = {h.payload(pages[0]) for _keys, pages in work}
        errors: list[BaseException] = []
        start = threading.Barrier(self.threads)

        def writer(keys: list[str], pages: list[int]) -> None:
            try:
                start.wait()
                assert h.store.put(keys, pages) == [True] * len(keys)
                assert h.store.put([shared], pages[:1]) == [True]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=item) for item in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for keys, _pages in work:
            h.scribble(out[:4])
            assert h.store.get(keys, out[:4]) == [True] * 4
            assert h.payloads(out[:4]) == [expected[k] for k in keys]
        assert h.store.get([shared], out[:1]) == [True]
        assert h.payload(out[0]) in candidates

    def test_kit_readers_never_see_torn_pages(self, kit: KitEnv) -> None:
        h = kit.open(num_pages=12)
        (key,) = h.keys(1)
        sources = h.pool.allocate(4)
        for i, page in enumerate(sources):
            h.fill([page], seed=200 + i)
        versions = set(h.payloads(sources))
        assert h.store.put([key], sources[:1]) == [True]
        readers_out = h.pool.allocate(4)
        stop = threading.Event()
        errors: list[BaseException] = []

        def write() -> None:
            try:
                for round_ in range(30):
                    h.store.put([key], [sources[round_ % len(sources)]])
            except BaseException as exc:
                errors.append(exc)
            finally:
                stop.set()

        def read(page: int) -> None:
            try:
                while not stop.is_set():
                    if h.store.get([key], [page]) == [True]:
                        assert h.payload(page) in versions
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write)]
        threads += [threading.Thread(target=read, args=(p,)) for p in readers_out]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert h.store.stats()["invalid"] == 0, "a reader saw a torn page"
