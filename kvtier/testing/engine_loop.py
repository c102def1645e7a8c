"""An engine-like forward loop that drives the vLLM device worker the way vLLM does.

:class:`EngineLoop` stands in for a vLLM worker on an accelerator, without vLLM: a stack of
``layers`` layers, each doing real matmuls on the device (``hidden`` and ``tokens`` set how
long a layer computes), and a paged KV cache in vLLM's accelerator layout (per layer
``[num_blocks, kv_heads, block_size, 2 * head_dim]`` over token-major memory, as vLLM 0.32
allocates it) registered with :class:`~kvtier.integrations.vllm.device_worker.DeviceWorkerSide`.
Each :meth:`EngineLoop.step` calls the connector hooks in vLLM's order:

1. ``start_load_kv`` -> :meth:`DeviceWorkerSide.start_loads`;
2. per layer: ``wait_for_layer_load`` -> ``wait_layer``, the layer's compute (which also
   reads its KV blocks, as attention would), ``save_kv_layer`` -> ``save_layer``;
3. ``wait_for_save`` -> ``end_step``; ``get_finished`` -> ``finished``.

Three load modes make the overlap measurable: ``"none"`` (no loads), ``"sync"`` (every
layer loaded before the forward, ``finish_loads``) and ``"overlap"`` (the worker's default:
layer ``i`` loaded at its own ``wait_for_layer_load``, so its copy can run under layer
``i - 1``'s compute). :meth:`EngineLoop.save_prefix` stores a prefix of pages once;
:meth:`EngineLoop.wrong_bytes` compares what a step loaded with what was saved, raw.
``benchmarks/engine_loop.py`` times the modes; the tests run one small step on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import torch

from kvtier.core.errors import InvalidFieldError
from kvtier.integrations.vllm.device_worker import DeviceWorkerSide
from kvtier.integrations.vllm.messages import PageOp
from kvtier.integrations.vllm.plan import resolve_plan
from kvtier.integrations.vllm.settings import VLLMSection
from kvtier.plugins.manager import default_registry
from kvtier.plugins.registry import Registry

__all__ = ["MODES", "EngineLoop", "FullAttentionSpec", "LoopShape", "Mode"]

Mode = Literal["none", "sync", "overlap"]
MODES: tuple[Mode, ...] = ("none", "sync", "overlap")


@dataclass(frozen=True)
class LoopShape:
    """The model and cache the loop runs: KV geometry, compute per layer, pages loaded.

    ``hidden`` and ``tokens`` size each layer's ``matmuls`` products of ``[tokens, hidden]``
    by ``[hidden, hidden]``: pick them so a layer computes at least as long as one layer
    of ``load_pages`` pages takes to load, or the overlap has nothing to hide under.
    """

    layers: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    num_blocks: int = 32
    load_pages: int = 8
    hidden: int = 256
    tokens: int = 64
    matmuls: int = 2
    compute_dtype: torch.dtype = torch.float32

    def check(self) -> None:
        """Refuse shapes the loop cannot run, naming the field."""
        for name in (
            "layers",
            "kv_heads",
            "head_dim",
            "block_size",
            "num_blocks",
            "load_pages",
            "hidden",
            "tokens",
            "matmuls",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidFieldError(
                    name, f"must be a positive integer, got {value!r}", value=value
                )
        if 2 * self.load_pages > self.num_blocks:
            raise InvalidFieldError(
                "load_pages",
                f"{self.load_pages} pages are saved from one set of blocks and loaded into "
                f"another: num_blocks ({self.num_blocks}) must be at least twice that",
                value=self.load_pages,
            )


@dataclass
class FullAttentionSpec:
    """The fields of vLLM's ``FullAttentionSpec`` that kvtier's plan reads (same class name)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.bfloat16
    sliding_window: int | None = None
    head_size_v: int | None = None


def layer_name(layer: int) -> str:
    """vLLM's attention layer name of model layer ``layer``."""
    return f"model.layers.{layer}.self_attn.attn"


@dataclass
class StepTimes:
    """Seconds of each step, by mode, in the order they ran."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})


class EngineLoop:
    """A small model's forward loop on ``device`` with kvtier's vLLM device worker attached.

    ``section`` adds to (or overrides) the ``kvtier`` section: by default a memory backend,
    the ``auto`` IO backend and a host pool of ``2 * load_pages`` pages. Close it when done.
    """

    def __init__(
        self,
        shape: LoopShape,
        device: torch.device | str,
        *,
        section: dict[str, Any] | None = None,
        registry: Registry | None = None,
        seed: int = 0,
    ) -> None:
        shape.check()
        self.shape = shape
        self.device = torch.device(device)
        settings: dict[str, Any] = {
            "backend": "memory",
            "host_pages": max(2 * shape.load_pages, 4),
            **(section or {}),
        }
        self.section = VLLMSection.model_validate(settings)
        spec = FullAttentionSpec(shape.block_size, shape.kv_heads, shape.head_dim)
        names = [layer_name(i) for i in range(shape.layers)]
        vllm_config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
            model_config=SimpleNamespace(use_mla=False, model="engine-loop", revision="r1"),
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
            # the accelerator strategy, whatever device the tensors are on (CPU in tests)
            device_config=SimpleNamespace(device_type="cuda"),
        )
        kv_cache_config = SimpleNamespace(
            num_blocks=shape.num_blocks,
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=list(names))],
        )
        plan = resolve_plan(
            vllm_config,
            kv_cache_config,
            self.section,
            registry or default_registry(),
            tp_rank=0,
        )
        self.names = names
        # every tensor is made on the device itself: gigabytes of weights drawn on a CPU
        # would take longer than the measurement
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.kv_caches: dict[str, torch.Tensor] = {}
        for name in reversed(names):  # vLLM hands them over in its own order
            memory = torch.empty(
                shape.num_blocks,
                shape.block_size,
                shape.kv_heads,
                2 * shape.head_dim,
                dtype=torch.bfloat16,
                device=self.device,
            )
            memory.view(torch.int16).random_(-(1 << 15), 1 << 15, generator=gen)
            self.kv_caches[name] = memory.permute(0, 2, 1, 3)  # [B, H, N, 2D], token-major
        self.worker = DeviceWorkerSide(plan, self.section)
        self.worker.register(self.kv_caches, {n: i for i, n in enumerate(names)}, shape.num_blocks)
        scale = shape.hidden**-0.5
        self.weights = [
            torch.randn(
                shape.hidden,
                shape.hidden,
                generator=gen,
                device=self.device,
                dtype=shape.compute_dtype,
            ).mul_(scale)
            for _ in range(shape.layers)
        ]
        self.x0 = torch.randn(
            shape.tokens, shape.hidden, generator=gen, device=self.device, dtype=shape.compute_dtype
        )
        self.saved_blocks = list(range(shape.load_pages))
        self.load_blocks = list(range(shape.load_pages, 2 * shape.load_pages))
        self.keys = [f"engine-loop-page-{i}" for i in range(shape.load_pages)]
        self.expected: dict[str, torch.Tensor] = {}
        self._steps = 0

    # --- the hooks, in vLLM's order ------------------------------------------------------

    def sync(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _compute(self, layer: int, x: torch.Tensor, blocks: torch.Tensor | None) -> torch.Tensor:
        """One layer: ``matmuls`` products and, as attention would, a read of its KV blocks."""
        weight = self.weights[layer]
        for _ in range(self.shape.matmuls):
            x = torch.tanh(x @ weight)
        if blocks is not None:  # depends on the loaded bytes; adds exactly zero
            touched = self.kv_caches[self.names[layer]].index_select(0, blocks)
            x = x + touched.view(torch.int16).sum().to(x.dtype) * 0
        return x

    def step(self, mode: Mode, saves: list[PageOp] | None = None) -> float:
        """One forward step with ``mode``'s loads (and ``saves``); its seconds, device drained.

        ``"sync"`` and ``"overlap"`` load the saved prefix into the load blocks (call
        :meth:`save_prefix` first); ``"none"`` loads nothing but makes the same calls.
        """
        if mode not in MODES:
            raise InvalidFieldError(
                "mode", f"must be one of {list(MODES)}, got {mode!r}", value=mode
            )
        if mode != "none" and not self.expected:
            raise InvalidFieldError(
                "mode", f"{mode!r} loads the saved prefix: call save_prefix() first", value=mode
            )
        worker, saves = self.worker, saves or []
        self._steps += 1
        loads = (
            []
            if mode == "none"
            else [PageOp(f"load-{self._steps}", self.keys, self.load_blocks, 0)]
        )
        blocks = torch.tensor(self.load_blocks, device=self.device) if loads else None
        self.sync()
        start = time.perf_counter()
        worker.start_loads(loads)  # start_load_kv
        if mode == "sync":
            worker.finish_loads()  # every layer in place before the forward
        x = self.x0
        for layer, name in enumerate(self.names):
            worker.wait_layer(name)  # wait_for_layer_load
            x = self._compute(layer, x, blocks)
            worker.save_layer(name, saves)  # save_kv_layer
        worker.end_step(saves)  # wait_for_save
        worker.finished(set())  # get_finished
        self.sync()
        return time.perf_counter() - start

    # --- saving and checking ---------------------------------------------------------------

    def _blocks_bytes(self, blocks: list[int]) -> dict[str, torch.Tensor]:
        index = torch.tensor(blocks, device=self.device)
        return {
            name: tensor.index_select(0, index).view(torch.int16).clone()
            for name, tensor in self.kv_caches.items()
        }

    def save_prefix(self, timeout: float = 60.0) -> None:
        """Store the prefix's pages from the save blocks in one step (per-layer saves), and
        wait until the host pool and the backend have them."""
        self.expected = self._blocks_bytes(self.saved_blocks)
        saves = [PageOp("prefix", self.keys, self.saved_blocks, 0)]
        self.step("none", saves)
        if not self.worker.flush(timeout):
            raise TimeoutError(f"engine loop: the prefix's backups did not finish in {timeout} s")
        stored = self.worker.take_report().stored
        missing = [k for k in self.keys if k not in stored]
        if missing:
            raise RuntimeError(
                f"engine loop: {len(missing)} prefix pages were not stored: {missing[:3]}"
            )

    def clear_load_blocks(self) -> None:
        """Zero the blocks loads write into, so a load that writes nothing shows."""
        index = torch.tensor(self.load_blocks, device=self.device)
        for tensor in self.kv_caches.values():
            tensor.index_fill_(0, index, 0)

    def wrong_bytes(self) -> int:
        """Bytes of the load blocks that differ from the saved prefix (all layers, K and V)."""
        loaded = self._blocks_bytes(self.load_blocks)
        wrong = 0
        for name, want in self.expected.items():
            got = loaded[name]
            wrong += int((got.view(torch.uint8) != want.view(torch.uint8)).sum().item())
        return wrong

    def load_errors(self) -> set[int]:
        """Blocks whose page did not load since the last call (vLLM would recompute them)."""
        return self.worker.take_load_errors()

    def run_modes(
        self, reps: int, warmup: int = 1, check: Callable[[Mode, int], None] | None = None
    ) -> StepTimes:
        """``warmup`` untimed rounds, then ``reps`` rounds of one step per mode, the order
        rotating each round so drift lands on every mode alike. Before each loading step
        the load blocks are zeroed; after it ``check(mode, wrong_bytes)`` is called."""
        times = StepTimes()
        for rep in range(warmup + reps):
            shift = rep % len(MODES)
            order = MODES[shift:] + MODES[:shift]
            for mode in order if rep % 2 == 0 else order[::-1]:
                if mode != "none":
                    self.clear_load_blocks()
                seconds = self.step(mode)
                if mode != "none" and check is not None:
                    check(mode, self.wrong_bytes())
                if rep >= warmup:
                    times.seconds[mode].append(seconds)
        return times

    def close(self) -> None:
        """Close the worker (drains its writes). Idempotent."""
        self.worker.close()
