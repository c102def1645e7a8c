"""A real ``mooncake_master`` on loopback, on free ports, for tests and benchmarks.

Tests and benchmarks that need a Mooncake master start one here rather than mocking it:
the failure modes worth testing (start-up without a master, a master killed mid-run, a
master coming back) only exist with the real server. The master keeps everything in
memory, so :meth:`MooncakeMaster.restart` on the same port gives a master that has
forgotten every object, exactly as a production restart does.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from kvtier.core.errors import StorageError

__all__ = [
    "MooncakeMaster",
    "client_env",
    "find_master_binary",
    "free_port",
    "mooncake_unavailable_reason",
    "port_open",
    "use_client_env",
]

#: Environment the Mooncake client needs on a loopback-only test host.
_CLIENT_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on ``host:port`` within ``timeout``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def find_master_binary() -> str | None:
    """The ``mooncake_master`` executable on PATH (the Mooncake wheels install it), or None."""
    return shutil.which("mooncake_master")


def mooncake_unavailable_reason() -> str | None:
    """Why a real master and client cannot run here (package or binary missing), or None."""
    if importlib.util.find_spec("mooncake") is None:
        return (
            "the Python package 'mooncake' is not installed (pip install "
            "'kvtier[mooncake-cpu]' on CPU hosts, 'kvtier[mooncake]' on GPU hosts)"
        )
    if find_master_binary() is None:
        return "the 'mooncake_master' executable is not on PATH (it comes with the Mooncake wheel)"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:  # e.g. libibverbs1 or CUDA libraries missing
        return f"the Mooncake client cannot be imported: {exc}"
    return None


def client_env() -> dict[str, str]:
    """Environment variables a Mooncake client on this loopback test host needs."""
    return dict(_CLIENT_ENV)


class MooncakeMaster:
    """One ``mooncake_master`` process on 127.0.0.1; every port it opens is a free one.

    ``lease_ttl_ms`` sets how long a get protects an object from ``remove`` (Mooncake's
    default is 10 s). ``storage_node_bytes`` also starts a ``mooncake_client`` storage node
    contributing that much memory, so pages outlive the processes that put them (kvtier
    clients can then run with ``global_segment_size=0``). Logs go to a temporary
    directory whose tail is quoted in any start-up error.
    """

    def __init__(
        self,
        *,
        lease_ttl_ms: int | None = None,
        storage_node_bytes: int = 0,
        binary: str | None = None,
    ) -> None:
        found = binary or find_master_binary()
        if found is None:
            raise StorageError(
                "cannot start a Mooncake master: 'mooncake_master' is not on PATH; install "
                "'kvtier[mooncake-cpu]' (CPU hosts) or 'kvtier[mooncake]' (GPU hosts)"
            )
        self.binary = found
        self.lease_ttl_ms = lease_ttl_ms
        self.host = "127.0.0.1"
        self.port = free_port()
        self._metrics_port = free_port()
        self._http_port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self.storage_node_bytes = int(storage_node_bytes)
        self._node: subprocess.Popen[bytes] | None = None
        self._node_port = free_port()
        self._log_dir = Path(tempfile.mkdtemp(prefix="kvtier-mooncake-master-"))
        self.log_path = self._log_dir / "master.log"

    @property
    def address(self) -> str:
        """``host:port`` of the master's RPC service, for ``master_address``."""
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the master process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def _argv(self) -> list[str]:
        argv = [
            self.binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self._metrics_port}",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self._http_port}",
            "--enable_http_metadata_server=false",
        ]
        if self.lease_ttl_ms is not None:
            argv.append(f"--default_kv_lease_ttl={int(self.lease_ttl_ms)}")
        return argv

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def start(self, timeout: float = 20.0) -> MooncakeMaster:
        """Start the master and wait until its RPC port accepts connections."""
        if self.running:
            return self
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self._argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise StorageError(
                    f"mooncake_master exited with status {self._proc.returncode} at start-up "
                    f"(port {self.port} taken?); its log ends with:\n{self._log_tail()}"
                )
            if port_open(self.host, self.port):
                if self.storage_node_bytes and self._node is None:
                    self._start_node(deadline)
                return self
            time.sleep(0.05)
        self.kill()
        self._stop_node()
        raise StorageError(
            f"mooncake_master did not accept connections on {self.address} within "
            f"{timeout:g} s; its log ends with:\n{self._log_tail()}"
        )

    def _start_node(self, deadline: float) -> None:
        binary = shutil.which("mooncake_client")
        if binary is None:
            raise StorageError("'mooncake_client' (the storage node) is not on PATH")
        log_path = self._log_dir / "storage-node.log"
        with log_path.open("ab") as log:
            self._node = subprocess.Popen(
                [
                    binary,
                    f"--master_server_address={self.address}",
                    "--metadata_server=P2PHANDSHAKE",
                    f"--global_segment_size={self.storage_node_bytes}",
                    f"--host={self.host}",
                    f"--port={self._node_port}",
                    "--protocol=tcp",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **_CLIENT_ENV},
            )
        while time.monotonic() < deadline:
            if self._node.poll() is not None:
                raise StorageError(
                    f"the Mooncake storage node exited with status {self._node.returncode}; "
                    f"its log ends with:\n{log_path.read_text(errors='replace')[-2000:]}"
                )
            if port_open(self.host, self._node_port):
                return
            time.sleep(0.05)
        raise StorageError(f"the Mooncake storage node did not start; see {log_path}")

    def _stop_node(self) -> None:
        if self._node is not None and self._node.poll() is None:
            self._node.kill()
        if self._node is not None:
            self._node.wait()
        self._node = None

    def kill(self) -> None:
        """Kill the master abruptly (SIGKILL), as a crash would, and reap it."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
        if self._proc is not None:
            self._proc.wait()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the master (SIGTERM, then SIGKILL after ``timeout``)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._proc = None

    def restart(self, timeout: float = 20.0) -> MooncakeMaster:
        """Start a fresh master on the same port (it knows no objects), after a kill/stop."""
        self.kill()
        self._proc = None
        deadline = time.monotonic() + timeout
        while port_open(self.host, self.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.start(max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop the storage node and the master, and remove the log directory."""
        self._stop_node()
        self.stop()
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def use_client_env() -> None:
    """Set the loopback client environment in this process where it is not set already."""
    for name, value in _CLIENT_ENV.items():
        os.environ.setdefault(name, value)
