"""Mooncake's numeric error codes by name, for counters such as ``put_failed.OBJECT_HAS_LEASE``.

One table, so that every failure is counted under the name Mooncake's own logs use.
"""

from __future__ import annotations

__all__ = [
    "ERROR_NAMES",
    "MASTER_UNREACHABLE",
    "OBJECT_HAS_LEASE",
    "OBJECT_NOT_FOUND",
    "REPLICA_IS_NOT_READY",
    "RPC_FAIL",
    "error_name",
]

#: Mooncake's ErrorCode values (mooncake-store/include/types.h) by number.
ERROR_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -709: "OBJECT_NO_REPLICATION_TASK",
    -710: "REPLICA_NOT_FOUND",
    -711: "REPLICA_ALREADY_EXISTS",
    -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -1000: "ETCD_OPERATION_ERROR",
    -1001: "ETCD_KEY_NOT_EXIST",
    -1002: "ETCD_TRANSACTION_FAIL",
    -1003: "ETCD_CTX_CANCELLED",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
    -1100: "FILE_NOT_FOUND",
    -1101: "FILE_OPEN_FAIL",
    -1102: "FILE_READ_FAIL",
    -1103: "FILE_WRITE_FAIL",
    -1104: "FILE_INVALID_BUFFER",
    -1105: "FILE_LOCK_FAIL",
    -1106: "FILE_INVALID_HANDLE",
    -1200: "BUCKET_NOT_FOUND",
    -1201: "BUCKET_ALREADY_EXISTS",
    -1202: "KEYS_EXCEED_BUCKET_LIMIT",
    -1203: "KEYS_ULTRA_LIMIT",
    -1300: "UNABLE_OFFLOAD",
    -1301: "UNABLE_OFFLOADING",
    -1400: "TASK_NOT_FOUND",
    -1401: "TASK_PENDING_LIMIT_EXCEEDED",
}
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900

#: Not Mooncake's: the name counted for calls the master guard fails at once.
MASTER_UNREACHABLE = "MASTER_UNREACHABLE"


def error_name(code: int) -> str:
    """Mooncake's name for a negative return code (``UNKNOWN_<code>`` if it is new)."""
    return ERROR_NAMES.get(int(code), f"UNKNOWN_{int(code)}")
