"""The built-in backends pass the conformance kit, exactly as a third party's would."""

from __future__ import annotations

from kvtier.testing import BackendKit, ConformanceTests


class TestMemoryBackendKit(BackendKit, ConformanceTests):
    backend_name = "memory"
    extra_config = {"capacity_bytes": 64 << 20}


class TestFileBackendKit(BackendKit, ConformanceTests):
    backend_name = "file"
    extra_config = {"root": "{tmp}/pages", "min_free_bytes": 0, "io_threads": 4}
