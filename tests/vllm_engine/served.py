"""A client for ``server.py``: one long-running real vLLM engine process taking requests.

Fleet tests and benchmarks run several engines at once and send requests while others
run; ``ServedEngine`` starts ``server.py`` with the vLLM environment's python, speaks its
JSON-lines protocol (see ``server.py``) and hands back each request's ``done`` event. It
imports neither vLLM nor torch nor zmq, so it runs under kvtier's python or vLLM's.
vLLM's logging goes to a log file in the work directory, so it never blocks a pipe.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

SERVER = Path(__file__).resolve().parent / "server.py"
#: Replies of the one-at-a-time commands, by op.
_REPLIES = {
    "damage": "damaged",
    "flush": "flushed",
    "stats": "stats",
    "reset_prefix_cache": "reset",
    "quit": "bye",
}


class ServedEngine:
    """One ``server.py`` process: submit requests from any thread, collect their results."""

    def __init__(
        self,
        python: Path,
        job: dict[str, Any],
        workdir: Path,
        env: dict[str, str] | None = None,
        name: str = "engine",
    ) -> None:
        self.name = name
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.job_path = workdir / f"{name}.job.json"
        self.log_path = workdir / f"{name}.log"
        self.job_path.write_text(json.dumps(job))
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._control_lock = threading.Lock()
        self._ids = itertools.count()
        self._ready: dict[str, Any] | None = None
        self._results: dict[str, dict[str, Any]] = {}
        #: Ids submitted whose results were not taken yet.
        self._outstanding: set[str] = set()
        self._replies: collections.deque[dict[str, Any]] = collections.deque()
        #: Error events that name neither a request nor a command (a rejected duplicate id).
        self.errors: list[dict[str, Any]] = []
        self._eof = False
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open while the process runs
        self._proc = subprocess.Popen(
            [str(python), str(SERVER), str(self.job_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=workdir,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
            text=True,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"{name}-reader")
        self._reader.start()

    # --- the process's side ---------------------------------------------------------------

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                self._take(event)
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _take(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        with self._cond:
            if kind in ("ready", "startup_error"):
                self._ready = event
            elif kind == "done" or (kind == "error" and "id" in event):
                self._results[str(event["id"])] = event
            elif kind in _REPLIES.values() or (kind == "error" and event.get("op") in _REPLIES):
                self._replies.append(event)
            elif kind == "error":
                self.errors.append(event)
            self._cond.notify_all()

    def _send(self, command: dict[str, Any]) -> None:
        line = json.dumps(command) + "\n"
        with self._send_lock:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(line)
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError) as exc:
                raise RuntimeError(self._gone(f"cannot send {command.get('op')}: {exc}")) from exc

    def _gone(self, what: str) -> str:
        return f"{self.name}: {what} (exit {self._proc.poll()}); log tail:\n{self.log_tail()}"

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        """Wait (holding ``_cond``) until ``ready()``; raise on timeout or the process's end."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self._eof:
                raise RuntimeError(self._gone(f"the server ended while waiting for {what}"))
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(self._gone(f"no {what} in {timeout} s"))
            self._cond.wait(min(left, 1.0))

    # --- the caller's side ----------------------------------------------------------------

    def wait_ready(self, timeout: float = 300) -> dict[str, Any]:
        """The ``ready`` event; RuntimeError (with the log's tail) if the engine did not start."""
        with self._cond:
            self._wait(lambda: self._ready is not None, timeout, "ready")
            assert self._ready is not None
            event = self._ready
        if event["event"] != "ready":
            raise RuntimeError(
                self._gone(f"startup error {event.get('type')}: {event.get('message')}")
            )
        return event

    @property
    def block_size(self) -> int:
        """The block size vLLM settled on (waits for the engine to be ready)."""
        return int(self.wait_ready()["block_size"])

    @property
    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The server process's id."""
        return self._proc.pid

    def submit(
        self,
        id: str,
        prompt: Sequence[int],
        max_tokens: int = 8,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """Send one greedy request; it runs alongside whatever the engine is running."""
        with self._cond:
            if id in self._outstanding:
                raise ValueError(f"{self.name}: request {id!r} is already outstanding")
            self._outstanding.add(id)
        try:
            self._send(
                {
                    "op": "submit",
                    "id": id,
                    "prompt": list(prompt),
                    "max_tokens": max_tokens,
                    "cache_salt": cache_salt,
                    "kv_transfer_params": kv_transfer_params,
                }
            )
        except RuntimeError:
            with self._cond:
                self._outstanding.discard(id)
            raise

    def result(self, id: str, timeout: float = 120) -> dict[str, Any]:
        """Request ``id``'s ``done`` event (taken once); RuntimeError if it failed."""
        with self._cond:
            self._wait(lambda: id in self._results, timeout, f"result of {id!r}")
            event = self._results.pop(id)
            self._outstanding.discard(id)
        if event["event"] != "done":
            raise RuntimeError(f"{self.name}: request {id!r} failed: {event.get('message')}")
        return event

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int = 8,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        timeout: float = 120,
    ) -> list[dict[str, Any]]:
        """Submit every prompt at once, then collect their ``done`` events in order."""
        ids = [f"{self.name}-{next(self._ids)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.submit(request_id, prompt, max_tokens, cache_salt, kv_transfer_params)
        return [self.result(request_id, timeout) for request_id in ids]

    def _control(self, op: str, wait: float, **fields: Any) -> dict[str, Any]:
        """Send a one-at-a-time command and wait up to ``wait`` seconds for its reply."""
        with self._control_lock:
            self._send({"op": op, **fields})
            with self._cond:
                self._wait(lambda: bool(self._replies), wait, f"reply to {op}")
                reply = self._replies.popleft()
        if reply["event"] != _REPLIES[op]:
            raise RuntimeError(f"{self.name}: {op} failed: {reply.get('message', reply)}")
        return reply

    def flush(self, timeout: float = 120) -> None:
        """Wait until every store kvtier's worker queued has landed."""
        self._control("flush", timeout)

    def stats(self, timeout: float = 60) -> dict[str, Any]:
        """The scheduler's and the worker's ``kvtier_stats()`` (None without kvtier)."""
        reply = self._control("stats", timeout)
        return {key: reply.get(key) for key in ("scheduler", "worker", "tenants")}

    def damage(self, prompt: Sequence[int], pages: Sequence[int], how: str = "flip") -> list[str]:
        """Flip a bit of (``how="flip"``) or delete (``"delete"``) ``prompt``'s stored
        ``pages`` in the store this engine writes; their storage keys."""
        reply = self._control("damage", 120, prompt=list(prompt), pages=list(pages), how=how)
        return list(reply["keys"])

    def reset_prefix_cache(self, timeout: float = 120) -> bool:
        """Empty vLLM's prefix cache once no request holds blocks; whether it was emptied."""
        return bool(self._control("reset_prefix_cache", timeout + 10, timeout=timeout)["ok"])

    def quit(self, timeout: float = 30) -> None:
        """Ask the server to shut kvtier down and exit; kill it if it does not."""
        if self.alive:
            with contextlib.suppress(RuntimeError, TimeoutError):
                self._control("quit", timeout)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._close()

    def kill(self) -> None:
        """SIGKILL the server (a crash, for the tests that need one)."""
        self._proc.kill()
        self._proc.wait()
        self._close()

    def _close(self) -> None:
        self._reader.join(timeout=5)
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._log.close()

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the server's log (vLLM's stdout and stderr)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def __enter__(self) -> ServedEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.alive:
            self.quit()
        else:
            self._proc.wait()
            self._close()
