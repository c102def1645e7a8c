"""Serve one real vLLM engine to a client over JSON lines, requests arriving while others run.

``python tests/vllm_engine/server.py JOB.json``, with the vLLM environment's python; the
client is ``served.py``'s ``ServedEngine``. ``engine.py`` runs one engine over a fixed batch
job; fleet tests and benchmarks need several engines alive at once, each taking requests
as they come and reporting each one's tokens, cached tokens and latencies as it finishes.

The job takes ``engine.py``'s keys where they apply (``model``, ``connector`` with its
``kvtier`` section, ``block_size`` 32, ``max_model_len`` 1024, ``max_num_seqs``,
``max_num_batched_tokens``, ``num_gpu_blocks``, ``prefix_caching`` on, ``log_stats``), plus
``kv_role`` (the connector's, ``kv_both`` unless given) and ``kv_events_endpoint`` (vLLM
publishes its KV cache events there, over ZMQ, for a subscriber outside this process).

Protocol: one JSON object a line. vLLM logs to stdout, so the protocol keeps a private copy
of fd 1 and fd 1 goes to stderr before vLLM is imported. The server says ``ready`` (with
vLLM's settled ``block_size``, ``startup_s``, ``pid``) or ``startup_error`` (``type``,
``message``) and exits. Commands on stdin, by ``op``:

- ``submit`` (``id``, ``prompt`` token ids, ``max_tokens``, ``cache_salt``,
  ``kv_transfer_params``): greedy generation; when it finishes, ``done`` with ``id``,
  ``tokens``, ``cached`` (vLLM's ``num_cached_tokens``), ``ttft_s`` and ``e2e_s`` (from the
  moment the submit line was read) and ``kv_transfer_params``.
- ``flush``: every store kvtier's worker queued has landed; ``flushed``.
- ``stats``: ``stats`` with the scheduler's and the worker's ``kvtier_stats()`` (or null),
  and the worker's storage chain's ``tenant_stats()`` (bytes per tier, quota evictions).
- ``reset_prefix_cache``: once no request holds blocks, empty vLLM's prefix cache;
  ``reset`` with ``ok``.
- ``damage`` (``prompt``, ``pages``, ``how``: ``flip`` or ``delete``): once the worker's
  stores landed, flip one payload bit of each of the prompt's stored pages, or delete
  them, through the backend the worker writes; ``damaged`` with their storage keys.
- ``quit`` (or end of stdin): shut kvtier's worker down, ``bye``, exit.

A failure is ``error`` with ``message`` and the request's ``id`` or the command's ``op``.
The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and only the
main thread drives it; a thread reads stdin into a queue.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import sys
import threading
import time
import traceback
from types import ModuleType
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
#: Seconds the loop waits for a command when the engine has nothing to step.
IDLE_WAIT = 0.02


class _Protocol:
    """Writes protocol lines, one flushed JSON object each, to a private copy of stdout."""

    def __init__(self, fd: int) -> None:
        self._out = os.fdopen(fd, "w", buffering=1)
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, default=str)
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()


def _read_stdin(commands: queue.Queue[tuple[float, dict[str, Any]]]) -> None:
    """Put each command line, with the time it was read, on ``commands``; quit at EOF."""
    for line in sys.stdin:
        if not line.strip():
            continue
        read = time.monotonic()
        try:
            command = json.loads(line)
            if not isinstance(command, dict):
                raise ValueError("a command is a JSON object")
        except ValueError as exc:
            command = {"op": "_bad", "message": f"bad command line {line[:200]!r}: {exc}"}
        commands.put((read, command))
    commands.put((time.monotonic(), {"op": "quit"}))


def _build(job: dict[str, Any], helpers: ModuleType) -> Any:
    """The ``LLM`` the job describes (in-process engine core, greedy-ready, no tokenizer)."""
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    transfer = helpers._connector_config(job)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    if job.get("kv_events_endpoint"):
        kwargs["kv_events_config"] = helpers.kv_events_config(job["kv_events_endpoint"])
    return LLM(**helpers.engine_options(job), **kwargs)


class _Request:
    """A submitted request's times: when its line was read, when its first token came."""

    def __init__(self, read: float) -> None:
        self.read = read
        self.first: float | None = None


class Server:
    """The engine loop: takes commands between steps, reports finished requests."""

    def __init__(self, llm: Any, helpers: ModuleType, out: _Protocol) -> None:
        self.llm = llm
        self.helpers = helpers
        self.out = out
        self.commands: queue.Queue[tuple[float, dict[str, Any]]] = queue.Queue()
        self.pending: dict[str, _Request] = {}

    # --- the loop -------------------------------------------------------------------------

    def serve(self) -> None:
        """Run until ``quit``: step while requests are unfinished, else wait for commands."""
        threading.Thread(target=_read_stdin, args=(self.commands,), daemon=True).start()
        llm_engine = self.llm.llm_engine
        while True:
            while True:
                try:
                    read, command = self.commands.get_nowait()
                except queue.Empty:
                    break
                self._command(read, command)
            if llm_engine.has_unfinished_requests():
                self._step()
                continue
            if self._scheduler_busy():
                # finished requests whose blocks wait for their stores are freed by steps
                self._step()
            try:
                read, command = self.commands.get(timeout=IDLE_WAIT)
            except queue.Empty:
                continue
            self._command(read, command)

    def _scheduler_busy(self) -> bool:
        core = self.helpers._engine_core()
        return bool(core is not None and core.scheduler.has_requests())

    def _step(self) -> None:
        try:
            outputs = self.llm.llm_engine.step()
        except Exception as exc:
            self._fail_pending(exc)
            return
        now = time.monotonic()
        for output in outputs:
            request = self.pending.get(output.request_id)
            if request is None:
                continue
            completion = output.outputs[0] if output.outputs else None
            tokens = list(completion.token_ids) if completion is not None else []
            if request.first is None and tokens:
                request.first = now
            if not output.finished:
                continue
            del self.pending[output.request_id]
            self.out.emit(
                "done",
                id=output.request_id,
                tokens=tokens,
                cached=int(output.num_cached_tokens or 0),
                ttft_s=(request.first if request.first is not None else now) - request.read,
                e2e_s=now - request.read,
                kv_transfer_params=output.kv_transfer_params,
            )

    def _fail_pending(self, exc: BaseException) -> None:
        """A step raised: every unfinished request fails with it, and is aborted."""
        message = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        ids = list(self.pending)
        self.pending.clear()
        if not ids:
            self.out.emit("error", message=message)
        for request_id in ids:
            self.out.emit("error", id=request_id, message=message)
        try:
            self.llm.llm_engine.abort_request(ids)
        except Exception:
            traceback.print_exc()

    # --- commands -------------------------------------------------------------------------

    def _command(self, read: float, command: dict[str, Any]) -> None:
        op = command.get("op")
        handler = {
            "submit": self._submit,
            "flush": self._flush,
            "stats": self._stats,
            "reset_prefix_cache": self._reset,
            "damage": self._damage,
            "quit": self._quit,
        }.get(str(op))
        if op == "_bad":
            self.out.emit("error", message=command["message"])
            return
        if handler is None:
            self.out.emit("error", op=op, message=f"unknown op {op!r}")
            return
        try:
            handler(read, command)
        except Exception as exc:
            traceback.print_exc()
            where = {"id": command["id"]} if op == "submit" and "id" in command else {"op": op}
            self.out.emit("error", message=f"{type(exc).__name__}: {exc}", **where)

    def _submit(self, read: float, command: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        request_id = str(command["id"])
        if request_id in self.pending:  # not under ``id``: that one's result is still due
            message = f"request {request_id!r} is already running"
            self.out.emit("error", rejected_id=request_id, message=message)
            return
        prompt = TokensPrompt(prompt_token_ids=list(command["prompt"]))
        if command.get("cache_salt") is not None:
            prompt["cache_salt"] = command["cache_salt"]
        extra = {}
        if command.get("kv_transfer_params") is not None:
            extra["extra_args"] = {"kv_transfer_params": command["kv_transfer_params"]}
        params = SamplingParams(
            temperature=0,
            max_tokens=int(command.get("max_tokens", 8)),
            detokenize=False,
            **extra,
        )
        # vLLM appends a random suffix to the id inside; outputs carry the id given here
        self.llm.llm_engine.add_request(request_id, prompt, params)
        self.pending[request_id] = _Request(read)

    def _flush(self, read: float, command: dict[str, Any]) -> None:
        _, worker = self.helpers._connectors()
        self.helpers._flush(worker)
        self.out.emit("flushed")

    def _stats(self, read: float, command: dict[str, Any]) -> None:
        scheduler, worker = self.helpers._connectors()
        store = getattr(getattr(worker, "worker", None), "store", None)
        tenants = getattr(store, "tenant_stats", None)
        self.out.emit(
            "stats",
            scheduler=scheduler.kvtier_stats() if hasattr(scheduler, "kvtier_stats") else None,
            worker=worker.kvtier_stats() if hasattr(worker, "kvtier_stats") else None,
            tenants=tenants() if callable(tenants) else None,
        )

    def _damage(self, read: float, command: dict[str, Any]) -> None:
        """Flip one payload bit of each of ``prompt``'s stored ``pages`` (``how``: "flip"),
        or delete them ("delete"), in the store the worker writes, once its stores landed;
        ``damaged`` with the storage keys."""
        scheduler, worker = self.helpers._connectors()
        how = str(command.get("how", "flip"))
        prompt = list(command["prompt"])
        keys = [
            self.helpers._damage_page(scheduler, worker, prompt, page, how=how)
            for page in command["pages"]
        ]
        self.out.emit("damaged", keys=keys)

    def _reset(self, read: float, command: dict[str, Any]) -> None:
        """Step (reporting what finishes) until no request holds blocks, then reset."""
        deadline = time.monotonic() + float(command.get("timeout", 120.0))
        ok = False
        while time.monotonic() < deadline:
            if self.llm.llm_engine.has_unfinished_requests() or self._scheduler_busy():
                self._step()
                continue
            if self.llm.reset_prefix_cache():
                ok = True
                break
            time.sleep(0.01)
        self.out.emit("reset", ok=ok)

    def _quit(self, read: float, command: dict[str, Any]) -> None:
        _, worker = self.helpers._connectors()
        try:
            if worker is not None and hasattr(worker, "shutdown"):
                worker.shutdown()
        finally:
            self.out.emit("bye")
            sys.stderr.flush()
            os._exit(0)


def main() -> None:
    # the protocol's own stdout; vLLM's logging (to fd 1) goes to stderr from here on
    out = _Protocol(os.dup(1))
    os.dup2(2, 1)
    with open(sys.argv[1]) as handle:
        job = json.load(handle)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # engine.py and hooks.py beside this file; kvtier from this checkout when not installed
    paths = [HERE]
    if importlib.util.find_spec("kvtier") is None and os.path.isdir(os.path.join(ROOT, "kvtier")):
        paths.append(ROOT)
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (*paths, os.environ.get("PYTHONPATH", "")) if p
    )
    import engine  # connector config and connector access

    started = time.perf_counter()
    try:
        llm = _build(job, engine)
    except Exception as exc:
        cause: BaseException = exc
        while cause.__cause__ is not None and type(cause).__module__.startswith("vllm"):
            cause = cause.__cause__
        traceback.print_exc()
        out.emit("startup_error", type=type(cause).__name__, message=str(cause))
        sys.stderr.flush()
        os._exit(1)
    engine._LLM = llm  # engine.py's helpers reach the connectors through it
    out.emit(
        "ready",
        block_size=int(llm.llm_engine.vllm_config.cache_config.block_size),
        startup_s=time.perf_counter() - started,
        pid=os.getpid(),
    )
    try:
        Server(llm, engine, out).serve()
    except BaseException as exc:
        traceback.print_exc()
        out.emit("error", message=f"server loop died: {type(exc).__name__}: {exc}")
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
