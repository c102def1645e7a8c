"""The ``example_sqlite`` storage backend: one table, one row per page."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Sequence

import kvtier.plugins
from kvtier_example_backend.plugin import SqliteConfig


class SqliteBackend(kvtier.plugins.StorageBackend):
    """Pages as BLOB rows keyed by page key. A row replace is atomic, so puts are too."""

    def __init__(self, config: SqliteConfig, context: kvtier.plugins.BackendContext) -> None:
        self.config = config
        self.namespace = context.namespace
        fd = os.open(config.path, os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
        self._db = sqlite3.connect(config.path, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={'FULL' if config.synchronous else 'OFF'}")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS pages (ns TEXT, key TEXT, data BLOB, PRIMARY KEY (ns, key))"
        )
        self._db.commit()
        self._lock = threading.Lock()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            found = {
                row[0]
                for key in keys
                for row in self._db.execute(
                    "SELECT key FROM pages WHERE ns = ? AND key = ?", (self.namespace, key)
                )
            }
        return [key in found for key in keys]

    def get(self, keys: Sequence[str], pages: Sequence[kvtier.plugins.PageBuffers]) -> list[bool]:
        results = []
        for key, page in zip(keys, pages, strict=True):
            with self._lock:
                row = self._db.execute(
                    "SELECT data FROM pages WHERE ns = ? AND key = ?", (self.namespace, key)
                ).fetchone()
            if row is None or len(row[0]) < sum(extent.length for extent in page):
                results.append(False)
                continue
            data, offset = memoryview(row[0]), 0
            for extent in page:
                extent.view[:] = data[offset : offset + extent.length]
                offset += extent.length
            results.append(True)
        return results

    def put(self, keys: Sequence[str], pages: Sequence[kvtier.plugins.PageBuffers]) -> list[bool]:
        rows = [
            (self.namespace, key, b"".join(extent.view for extent in page))
            for key, page in zip(keys, pages, strict=True)
        ]
        try:
            with self._lock, self._db:
                self._db.executemany("INSERT OR REPLACE INTO pages VALUES (?, ?, ?)", rows)
        except sqlite3.Error:
            return [False] * len(keys)
        return [True] * len(keys)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        results = []
        with self._lock, self._db:
            for key in keys:
                cursor = self._db.execute(
                    "DELETE FROM pages WHERE ns = ? AND key = ?", (self.namespace, key)
                )
                results.append(cursor.rowcount > 0)
        return results

    def clear(self) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM pages WHERE ns = ?", (self.namespace,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
