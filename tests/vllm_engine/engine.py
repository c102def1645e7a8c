"""Run one real vLLM engine over a job and write what happened as JSON.

``python tests/vllm/engine.py JOB.json RESULT.json``, with the vLLM environment's python.
The job names the model directory, the connector (none, ``kvtier`` with its section, or
vLLM's ``ExampleConnector``) and a list of phases, each a batch of token-id prompts run
with greedy sampling; between phases a stored page can be corrupted (one bit flipped
through the backend itself). The result holds, per phase, every prompt's output tokens,
vLLM's own count of tokens it did not compute (``num_cached_tokens``) and the wall time,
and, for kvtier, the scheduler's and the worker's cumulative counters. With
``"log_stats": true`` vLLM logs its stats after each phase (kvtier's counters among them,
as "KV Transfer metrics: ...", on stdout, where vLLM's logger writes). With
``"lora": {"max_rank": R}`` the engine serves LoRA adapters, and a phase's
``"lora": {"name", "id", "path"}`` runs its prompts under that adapter. With
``"multimodal": true`` the engine loads the model's tokenizer and processor (a model of
``tiny_mm_model.py``), and a prompt may be ``{"text": T, "image": SEED}``: text with that
seeded image; each output then also carries its prompt's token ids.

The connector's ``kv_role`` is ``kv_both`` unless the job gives ``"kv_role"``. vLLM's
prefix cache is on (its default) unless the job says ``"prefix_caching": false``;
a phase with ``"reset_prefix_cache": true`` first empties it (once kvtier's stores are done
and vLLM freed their blocks), as memory pressure would, so the phase's hits are kvtier's.
With ``"hooks": {...}`` the connector is ``tests/vllm_engine/hooks.py``'s, and a phase's
``"hooks"`` changes them for that phase on (in-process engine only). The job may set
``max_num_batched_tokens``, ``max_num_seqs``, ``num_gpu_blocks`` (a small KV space) and
``tp`` (tensor parallelism). Each output also carries its time to first token and
preemptions where vLLM's stats give them.

With ``"kv_events": true`` vLLM publishes its KV cache events (``kv_events_config``, ZMQ
on an ``ipc://`` endpoint); a SUB socket in this process receives them, decoded with
msgspec as any subscriber would, and each phase lists the events received during it
(``"kv_events"``: type, medium, block hashes as hex, parent, token ids, group). A phase's
``"warmup"`` prompt runs first (one token, output dropped), so the engine steps once and
the scheduler learns what the workers did since the last phase; ``"reset_connector":
true`` resets vLLM's prefix cache and the connector (``reset_prefix_cache(
reset_connector=True)``) first. With ``log_stats`` the result's ``"prometheus"`` holds
the samples of vLLM's Prometheus registry named ``vllm:kvtier_*`` and
``vllm:prompt_tokens_cached_by_source`` (by ``source``) after the last phase.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, unless the
job says ``"spawn": true``), so the connectors can be read after each phase. A start-up
failure is written as ``{"startup_error": {"type": ..., "message": ...}}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from typing import Any


def _connector_config(job: dict[str, Any]) -> dict[str, Any] | None:
    kind = job.get("connector")
    if kind is None:
        return None
    if kind == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": job["example_path"]},
        }
    config = {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": job.get("kv_role", "kv_both"),
        "kv_load_failure_policy": job.get("kv_load_failure_policy", "recompute"),
        "kv_connector_extra_config": {"kvtier": job["kvtier"]},
    }
    if "hooks" in job:
        config["kv_connector"] = "HookedKvtierConnector"
        config["kv_connector_module_path"] = "hooks"
        config["kv_connector_extra_config"]["kvtier_test"] = job["hooks"]
    return config


def kv_events_config(endpoint: str) -> dict[str, Any]:
    """vLLM's ``kv_events_config``: publish its KV cache events over ZMQ at ``endpoint``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}


def engine_options(job: dict[str, Any]) -> dict[str, Any]:
    """The ``LLM`` arguments every test engine shares, with the job's sizes: the model,
    greedy-ready bfloat16 without CUDA graphs, block size 32, prefix caching on, seed 0."""
    options: dict[str, Any] = {
        "model": job["model"],
        "skip_tokenizer_init": not job.get("multimodal"),
        "dtype": "bfloat16",
        "enforce_eager": True,
        "block_size": job.get("block_size", 32),
        "max_model_len": job.get("max_model_len", 1024),
        "enable_prefix_caching": bool(job.get("prefix_caching", True)),
        "disable_log_stats": not job.get("log_stats", False),
        "seed": 0,
    }
    for key, arg in (
        ("max_num_batched_tokens", "max_num_batched_tokens"),
        ("max_num_seqs", "max_num_seqs"),
        ("num_gpu_blocks", "num_gpu_blocks_override"),
        ("tp", "tensor_parallel_size"),
    ):
        if key in job:
            options[arg] = job[key]
    return options


def _connectors() -> tuple[Any, Any]:
    """The scheduler's and this process's worker connector (in-process engine only)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    return _scheduler_connector(), worker


_LLM: Any = None


def _scheduler_connector() -> Any:
    try:
        return _LLM.llm_engine.engine_core.engine_core.scheduler.connector
    except AttributeError:
        return None


def _damage_page(
    scheduler: Any, worker: Any, tokens: list[int], page: int, *, how: str = "flip", group: int = 0
) -> str:
    """Flip one payload bit of ``tokens``' stored page ``page`` (of KV cache group
    ``group``), or delete it (``how="delete"``), through the backend itself, once the
    worker's stores landed; the page's storage key."""
    from kvtier.core.envelope import ENVELOPE_BYTES
    from kvtier.core.extents import extent_of_view

    side = worker.worker
    key = side.names([scheduler.scheduler.keyers(None, None, group).keys(tokens)[page]])[0]
    backend = side.store.backend
    side.flush()  # every queued store has landed
    if how == "delete":
        _rewrite(backend, key, None)
        return key
    header = bytearray(ENVELOPE_BYTES)
    payload = bytearray(side.plan.geometry.bytes_per_page)
    regions = [extent_of_view(memoryview(header)), extent_of_view(memoryview(payload))]
    if not backend.get([key], [regions])[0]:
        raise RuntimeError(f"page {page} ({key}) is not stored; nothing to corrupt")
    payload[len(payload) // 2] ^= 0x10
    _rewrite(backend, key, regions)
    return key


def _rewrite(backend: Any, key: str, regions: Any, timeout: float = 30.0) -> None:
    """Delete ``key`` and write ``regions`` under it (None: leave it deleted). A store may
    keep the first value of a key (Mooncake) and refuse to remove a page read a moment
    ago (its read lease), so the delete is retried until the key is gone, and the write
    until the store takes it."""
    deadline = time.monotonic() + timeout
    while True:
        backend.delete([key])
        if not backend.exists([key])[0]:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"page {key} could not be removed within {timeout} s")
        time.sleep(0.2)
    while regions is not None and not backend.put([key], [regions])[0]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not write the damaged page {key} back")
        time.sleep(0.2)


def _flush(worker: Any) -> None:
    if getattr(worker, "worker", None) is not None:
        worker.worker.flush()


def _engine_core() -> Any:
    try:
        return _LLM.llm_engine.engine_core.engine_core
    except AttributeError:
        return None


def _reset_prefix_cache(timeout: float = 120.0, connector: bool = False) -> None:
    """Empty vLLM's prefix cache once no request holds blocks (kvtier's stores done), and
    reset the connector too with ``connector``.

    In-process, the engine core only steps while requests are unfinished, so it is stepped
    here until the finished requests whose blocks wait for their stores are freed.
    """
    deadline = time.monotonic() + timeout
    core = _engine_core()
    while True:
        if core is not None and core.scheduler.has_requests():
            core.step()
        elif _LLM.reset_prefix_cache(reset_connector=connector):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache could not be reset: blocks still held")
        time.sleep(0.01)


class _KVEvents:
    """A ZMQ SUB socket on vLLM's KV event publisher, decoding every batch it receives."""

    def __init__(self) -> None:
        import zmq

        self.endpoint = f"ipc://{tempfile.mkdtemp(prefix='kvev')}/events"
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(self.endpoint)
        self._events: list[dict[str, Any]] = []
        self._received = time.monotonic()
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop:
            if not self._socket.poll(100, zmq.POLLIN):
                continue
            _topic, _seq, payload = self._socket.recv_multipart()
            batch = decoder.decode(payload)
            with self._lock:
                self._events.extend(_event_row(event) for event in batch.events)
                self._received = time.monotonic()

    def take(self, quiet: float = 0.5, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The events received so far, once none arrived for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if time.monotonic() - self._received >= quiet:
                    break
            time.sleep(0.05)
        with self._lock:
            events, self._events = self._events, []
        return events


def _hex(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else value


def _event_row(event: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "type": type(event).__name__,
        "medium": getattr(event, "medium", None),
        "block_hashes": [_hex(h) for h in getattr(event, "block_hashes", [])],
        "group_idx": getattr(event, "group_idx", None),
    }
    if row["type"] == "BlockStored":
        row["parent"] = _hex(event.parent_block_hash)
        row["token_ids"] = list(event.token_ids)
        row["block_size"] = event.block_size
    return row


def _prometheus() -> dict[str, float]:
    """vLLM's Prometheus samples of kvtier's series and of cached tokens by source."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("vllm:kvtier_") and sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
            elif sample.name == "vllm:prompt_tokens_cached_by_source_total":
                name = f"{sample.name}{{source={sample.labels['source']}}}"
                out[name] = out.get(name, 0.0) + sample.value
    return out


def _set_hooks(hooks: dict[str, Any]) -> None:
    """Change the hooked connectors' hooks (in-process engine only)."""
    scheduler, worker = _connectors()
    for connector in (scheduler, worker):
        if connector is not None and hasattr(connector, "hooks"):
            connector.hooks.update(hooks)


def _lora_options(job: dict[str, Any]) -> dict[str, Any]:
    """The engine's LoRA settings when the job serves adapters (``"lora": {"max_rank": R}``)."""
    if "lora" not in job:
        return {}
    return {"enable_lora": True, "max_lora_rank": job["lora"]["max_rank"], "max_loras": 2}


def _lora_request(phase: dict[str, Any]) -> Any:
    """The phase's adapter (``"lora": {"name", "id", "path"}``), or None for the base model."""
    adapter = phase.get("lora")
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter["name"], adapter["id"], adapter["path"])


def _prompt(prompt: Any) -> Any:
    """A phase's prompt: token ids, or ``{"text", "image"}`` (text with a seeded image)."""
    from vllm.inputs import TokensPrompt

    if isinstance(prompt, dict):
        from tiny_mm_model import image

        return {"prompt": prompt["text"], "multi_modal_data": {"image": image(prompt["image"])}}
    return TokensPrompt(prompt_token_ids=prompt)


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Start the engine, run the phases, return the result (see the module docstring)."""
    global _LLM
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    kwargs: dict[str, Any] = {}
    transfer = _connector_config(job)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    events = _KVEvents() if job.get("kv_events") else None
    if events is not None:
        kwargs["kv_events_config"] = kv_events_config(events.endpoint)
    if job.get("multimodal"):
        kwargs["limit_mm_per_prompt"] = {"image": 1}
        if "mm_processor_cache_gb" in job:
            kwargs["mm_processor_cache_gb"] = job["mm_processor_cache_gb"]
    try:
        _LLM = LLM(**engine_options(job), **_lora_options(job), **kwargs)
    except Exception as exc:
        cause: BaseException = exc
        while cause.__cause__ is not None and type(cause).__module__.startswith("vllm"):
            cause = cause.__cause__
        return {
            "startup_error": {
                "type": type(cause).__name__,
                "module": type(cause).__module__,
                "message": str(cause),
            }
        }
    result: dict[str, Any] = {"startup_s": time.perf_counter() - started, "phases": []}
    # the block size vLLM settled on (a platform may change the one asked for: vLLM's CPU
    # build gives MLA models blocks of 16 tokens)
    result["block_size"] = int(_LLM.llm_engine.vllm_config.cache_config.block_size)
    for phase in job["phases"]:
        if phase.get("hooks"):
            _set_hooks(phase["hooks"])
        if phase.get("reset_prefix_cache") or phase.get("reset_connector"):
            _reset_prefix_cache(connector=bool(phase.get("reset_connector")))
        if phase.get("warmup"):
            warm = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
            _LLM.generate([_prompt(phase["warmup"])], warm, use_tqdm=False)
        scheduler, worker = _connectors()
        entry: dict[str, Any] = {"name": phase.get("name", "")}
        if "flip" in phase:
            flip = phase["flip"]
            pages = flip["pages"] if "pages" in flip else [flip["page"]]
            group = flip.get("group", 0)
            flipped = [
                _damage_page(scheduler, worker, flip["tokens"], p, group=group) for p in pages
            ]
            entry["flipped"] = flipped[0] if "page" in flip else flipped
        params = SamplingParams(
            temperature=0, max_tokens=phase.get("max_tokens", 8), detokenize=False
        )
        outputs = []
        t0 = time.perf_counter()
        for batch in (
            ([p] for p in phase["prompts"]) if phase.get("one_by_one") else [phase["prompts"]]
        ):
            prompts = [_prompt(p) for p in batch]
            outputs += _LLM.generate(
                prompts, params, use_tqdm=False, lora_request=_lora_request(phase)
            )
            if phase.get("one_by_one"):
                _flush(worker)
        entry["seconds"] = time.perf_counter() - t0
        _flush(worker)
        entry["tokens"] = [list(out.outputs[0].token_ids) for out in outputs]
        entry["cached"] = [int(out.num_cached_tokens or 0) for out in outputs]
        if job.get("multimodal"):
            entry["prompt_tokens"] = [list(out.prompt_token_ids or []) for out in outputs]
        entry["ttft"] = [getattr(out.metrics, "first_token_latency", None) for out in outputs]
        entry["preemptions"] = [getattr(out.metrics, "num_preemptions", 0) for out in outputs]
        if job.get("log_stats"):
            # vLLM's own stats path: the connectors' get_kv_connector_stats, summed over
            # workers and intervals by vLLM, logged as "KV Transfer metrics: ..."
            print(f"phase {entry['name']}:", flush=True)  # vLLM logs to stdout
            _LLM.llm_engine.do_log_stats()
        if scheduler is not None and hasattr(scheduler, "kvtier_stats"):
            entry["scheduler"] = scheduler.kvtier_stats()
        if worker is not None and hasattr(worker, "kvtier_stats"):
            entry["worker"] = worker.kvtier_stats()
        if events is not None:
            entry["kv_events"] = events.take()
        result["phases"].append(entry)
    if job.get("log_stats"):
        result["prometheus"] = _prometheus()
    _, worker = _connectors()
    if worker is not None and hasattr(worker, "shutdown"):
        worker.shutdown()
    shutdown = getattr(getattr(_LLM.llm_engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):  # a spawned engine core (and its workers) ends with this process
        shutdown()
    return result


def main() -> None:
    with open(sys.argv[1]) as handle:
        job = json.load(handle)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    here = os.path.dirname(os.path.abspath(__file__))  # hooks.py, for spawned processes too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p
    )
    if job.get("tp", 1) > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(job["tp"]))))
    if not job.get("spawn"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = run(job)
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)
    # vLLM's engine threads can keep the interpreter alive; the result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
