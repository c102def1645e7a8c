"""Two-tier chains run the kit's fault campaign, as a single backend does.

Each class names a chain as an engine config's ``tiers`` does; ``ChainKit`` opens it
through kvtier's one path and the mixins drive it: a cascade (or a read from below)
stalled past the bound and completing late, ENOSPC/EIO at every step of a put, kill -9
with puts in flight, a second instance that clears and writes, and queued cascades of
deleted or tainted keys. A chain declares what both its tiers declare, so a mixin gated
on a feature (a restart finds the pages, two processes share the store) runs only where
both tiers have it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.testing import ChainFaultCampaignTests, ChainKit
from kvtier.testing.kit.faults_chain import expand_tiers
from kvtier.testing.mooncake import MooncakeMaster


def _file(root: str) -> dict[str, Any]:
    return {"backend": "file", "extra_config": {"root": root, "min_free_bytes": 0}}


def _segment(root: str) -> dict[str, Any]:
    return {
        "backend": "segment",
        "extra_config": {"root": root, "min_free_bytes": 0, "segment_bytes": "1MiB"},
    }


class TestMemoryOverFile(ChainKit, ChainFaultCampaignTests):
    tiers = [
        {"backend": "memory", "extra_config": {"capacity_bytes": 64 << 20}},
        _file("{tmp}/lower"),
    ]


class TestFileOverSegment(ChainKit, ChainFaultCampaignTests):
    tiers = [_file("{tmp}/upper"), _segment("{tmp}/lower")]


class TestSegmentOverFile(ChainKit, ChainFaultCampaignTests):
    tiers = [_segment("{tmp}/upper"), {**_file("{tmp}/lower"), "write": "through"}]


class TestSegmentOverFileWriteBack(ChainKit, ChainFaultCampaignTests):
    """Segment's reclaim is the tier's choice: what it drops is written back below. The
    kill -9 comes once the segment tier has filled past its 4 MiB (16 KiB pages); the
    capacity leaves room for the active segment of each instance the campaign opens."""

    kill_keys = 120
    kill_after_acks = 300
    tiers = [
        {
            "backend": "segment",
            "extra_config": {
                "root": "{tmp}/upper",
                "min_free_bytes": 0,
                "segment_bytes": "1MiB",
                "capacity_bytes": "4MiB",
            },
        },
        {**_file("{tmp}/lower"), "write": "back"},
    ]


@pytest.mark.mooncake
class TestFileOverMooncake(ChainKit, ChainFaultCampaignTests):
    @pytest.fixture(autouse=True)
    def _master(self, request: pytest.FixtureRequest) -> None:
        master: MooncakeMaster = request.getfixturevalue("mooncake_master")
        self.master_address = master.address

    def chain_tiers(self, tmp: Path) -> list[dict[str, Any]]:
        mooncake = {"master_address": self.master_address, "global_segment_size": 0}
        return [
            *expand_tiers([_file("{tmp}/upper")], tmp),
            {"backend": "mooncake", "extra_config": mooncake},
        ]
