"""Options of the ``mooncake`` backend, with their validators."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

__all__ = ["MooncakeConfig", "parse_master_address"]

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")
_PREFIX = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: The smallest global segment Mooncake's client accepts (its setup fails below it).
MIN_SEGMENT_BYTES = 16 << 20


def parse_master_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` too); ValueError names the expected form."""
    match = _HOST_PORT.match(address.strip())
    port = int(match.group("port")) if match else 0
    if match is None or not 0 < port < 65536:
        raise ValueError(
            f"{address!r} is not host:port with a port in 1..65535 (e.g. '10.0.0.5:50051')"
        )
    return match.group("host").strip("[]"), port


class MooncakeConfig(BaseModel):
    """Options of the ``mooncake`` backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    master_address: str = Field(
        description="host:port of mooncake_master's RPC service (its --rpc_port).",
    )
    metadata_server: str = Field(
        default="P2PHANDSHAKE",
        min_length=1,
        description="Transfer-engine metadata service: 'P2PHANDSHAKE' (no extra server), "
        "or an etcd / http metadata URL.",
    )
    protocol: Literal["tcp", "rdma"] = Field(
        default="tcp", description="Transport between clients: 'tcp' or 'rdma'."
    )
    device_names: tuple[str, ...] = Field(
        default=(),
        description="RDMA devices to use (e.g. ['mlx5_0', 'mlx5_1']); empty lets Mooncake "
        "choose. Ignored for tcp.",
    )
    local_hostname: str | None = Field(
        default=None,
        description="Address other clients reach this one at. None: 127.0.0.1 when the "
        "master is on loopback, else the local address of the route to the master.",
    )
    global_segment_size: ByteSize = Field(
        default=ByteSize(1 << 30),
        ge=0,
        description="Bytes of memory this process contributes to the distributed store "
        "(0: a pure client). An integer or '4GiB'.",
    )
    capacity_bytes: ByteSize | None = Field(
        default=None,
        gt=0,
        description="Most bytes of pages this client keeps in the store (its own puts in "
        "its namespace); beyond it the pages it used least recently are removed first, "
        "and a put that still does not fit fails (put_failed.CAPACITY). None: bounded only "
        "by the store's segments (a full store refuses puts: NO_AVAILABLE_HANDLE).",
    )
    local_buffer_size: ByteSize = Field(
        default=ByteSize(16 << 20),
        ge=0,
        description="Mooncake's own client buffer; kvtier moves pages zero-copy and needs little.",
    )
    replica_num: int = Field(default=1, ge=1, le=16, description="Copies of each page.")
    op_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=600,
        description="Bound on the reachability probe of a master that stopped answering; "
        "while it is down every call fails at once instead of waiting on Mooncake's retries.",
    )
    setup_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="How long start-up waits for the master's port to accept connections "
        "before failing with a clear error (Mooncake alone retries for ~90 s).",
    )
    retry_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=600,
        description="While the master is down, how often a call probes it again.",
    )
    overwrite: Literal["replace", "keep"] = Field(
        default="replace",
        description="A put of an existing key: 'replace' removes the old object first "
        "(Mooncake itself keeps the old value); 'keep' skips that RPC, first write wins.",
    )
    unregistered_memory: Literal["stage", "error"] = Field(
        default="stage",
        description="Pages outside registered memory (no attach): 'stage' copies them "
        "through a registered staging buffer (WARNING once, counted); 'error' refuses.",
    )
    staging_buffer_size: ByteSize = Field(
        default=ByteSize(64 << 20),
        gt=0,
        description="Size of the staging buffer, allocated on first use.",
    )
    key_prefix: str = Field(
        default="kvtier",
        description="Object keys are '<key_prefix>/<namespace>/<page key>'; clear() removes "
        "exactly this backend's '<key_prefix>/<namespace>/' objects.",
    )

    @field_validator("master_address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        parse_master_address(value)
        return value.strip()

    @field_validator("global_segment_size")
    @classmethod
    def _check_segment(cls, value: ByteSize) -> ByteSize:
        if 0 < int(value) < MIN_SEGMENT_BYTES:
            raise ValueError(
                f"{int(value)} bytes is below Mooncake's minimum segment of "
                f"{MIN_SEGMENT_BYTES} bytes (16 MiB); use 0 (a pure client) or at least '16MiB'"
            )
        return value

    @field_validator("device_names")
    @classmethod
    def _check_devices(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not name or "," in name or name.strip() != name:
                raise ValueError(f"RDMA device name {name!r} must be non-empty, without ','")
        return value

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if not _PREFIX.match(value):
            raise ValueError(
                f"{value!r} must be 1-64 characters of letters, digits, '_', '.' or '-'"
            )
        return value
