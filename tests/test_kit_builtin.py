"""The built-in backends pass the conformance kit, exactly as a third party's would, and
run the kit's fault campaign (``FaultCampaignTests``) with their real parts: io_uring
where the kernel allows it, a Mooncake master on loopback, real child processes."""

from __future__ import annotations

import pytest
from test_mooncake import OnTheSessionMaster

from kvtier.backends.uring import URING_SPEC
from kvtier.testing import BackendKit, ConformanceTests, FaultCampaignTests, require


class TestMemoryBackendKit(BackendKit, ConformanceTests):
    backend_name = "memory"
    extra_config = {"capacity_bytes": 64 << 20}


class TestFileBackendKit(BackendKit, ConformanceTests):
    backend_name = "file"
    extra_config = {"root": "{tmp}/pages", "min_free_bytes": 0, "io_threads": 4}


# --- the fault campaign, every built-in backend --------------------------------------------


class TestMemoryFaults(BackendKit, FaultCampaignTests):
    backend_name = "memory"
    extra_config = {"capacity_bytes": 64 << 20}


class TestFileFaults(BackendKit, FaultCampaignTests):
    """The file backend as it runs by default (its compiled page loop)."""

    backend_name = "file"
    extra_config = {"root": "{tmp}/pages", "min_free_bytes": 0, "io_threads": 4}


class TestFilePythonLoopFaults(BackendKit, FaultCampaignTests):
    """The file backend with its Python page loop, whose every write is an ``os`` call,
    so ENOSPC and EIO reach each step of a put."""

    backend_name = "file"
    extra_config = {"root": "{tmp}/pages", "min_free_bytes": 0, "compiled_io": False}


class TestUringFaults(BackendKit, FaultCampaignTests):
    backend_name = "uring"
    extra_config = {"root": "{tmp}/pages", "min_free_bytes": 0, "queue_depth": 8}

    @pytest.fixture(autouse=True)
    def _needs_uring(self) -> None:
        require("uring", URING_SPEC.unavailable_reason())


class TestSegmentFaults(BackendKit, FaultCampaignTests):
    backend_name = "segment"
    extra_config = {"root": "{tmp}/segments", "min_free_bytes": 0, "segment_bytes": "1MiB"}


@pytest.mark.mooncake
class TestMooncakeFaults(OnTheSessionMaster, FaultCampaignTests):
    """The campaign against the session's Mooncake master."""
