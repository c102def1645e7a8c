"""IO backends: how KV pages move between a device pool (L1) and a host pool (L2).

The contract is :class:`IOBackend`: ``backup`` (device -> host) and ``load`` (host ->
device), all layers (``layer=None``) or one layer. Every call is validated in full before a
byte moves, and raises :class:`TransferError` naming the bad value otherwise; each check is
written once (:func:`check_device_slots`, :func:`check_layer`, and the host pool's
:func:`~kvtier.core.host_pool.check_host_page`) and runs once per call: a caller that ran
the first two already (TieredCache) says so with ``checked=True``. Data moves as raw bytes,
so float8 and bfloat16 pages round-trip bit-exactly.

Built-ins (declared in :data:`DIRECT_SPEC` and :data:`KERNEL_SPEC`):

- ``direct``: page-granular. Each device page (``page_size`` consecutive slots starting at
  a multiple of ``page_size``) is copied with strided ``copy_`` calls, one per run of
  consecutive pages per kv (all layers at once when the device pool's layer buffers are
  views of one tensor, else one per layer); on a CPU pool, a run of consecutive host
  pages from scattered device pages is one gather / ``index_copy_`` (but for
  ``page_head``, see :meth:`DirectIOBackend._moves`). Token-granular slots are refused.
- ``kernel``: token-granular. Any slots. A run of consecutive host pages whose slots are
  one ascending range moves with one strided ``copy_`` per kv covering all layers (or
  one layer); otherwise a backup gathers each host page with
  ``index_select(..., out=host_page)`` and a load scatters each run of consecutive host
  pages with one ``index_put_`` per kv.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvtier.core.device_pool import DevicePool, layer_buffers
from kvtier.core.errors import TransferError, UnsupportedCombinationError
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.host_pool import HostPool, check_host_page
from kvtier.core.layout import Layout, check_layout, layouts_for, page_axes, page_view
from kvtier.core.specs import Capability, EmptyConfig, IOBackendSpec, Operation
from kvtier.core.streams import PASSED, CopyStream, Fence, current_fence, is_cuda

__all__ = [
    "DIRECT_SPEC",
    "KERNEL_SPEC",
    "DirectIOBackend",
    "IOBackend",
    "KernelIOBackend",
    "TransferPlan",
    "capability_table",
    "check_device_slots",
    "check_layer",
    "check_slots_in_range",
    "full_matrix",
]

#: Axis order of a device pool's memory of one kv (see kvtier.core.device_pool).
_DEVICE_AXES = ("layer", "token", "head", "dim")

#: The most device memory a staged crossing (a CUDA pool) takes for one block of pages,
#: per kv: more pages cross in several blocks, so a large load fits beside the engine's
#: KV cache, which leaves little of the device free.
STAGE_BYTES = 64 << 20


def full_matrix(operations: Iterable[Operation] = tuple(Operation)) -> frozenset[Capability]:
    """Every (layout, attention, operation) a host pool can take, for ``operations``."""
    ops = tuple(operations)
    return frozenset(
        Capability(layout, attention, op)
        for attention in AttentionKind
        for layout in layouts_for(attention)
        for op in ops
    )


def check_device_slots(
    device_slots: Any,
    *,
    page_size: int,
    pages: int | None = None,
    num_slots: int | None = None,
) -> torch.Tensor:
    """The one device-slot validator: ``device_slots`` as int64, or a TransferError.

    Checks, in order, that it is a 1-D integer tensor, that it holds ``pages *
    page_size`` slots (when ``pages`` is given) and that every slot is below
    ``num_slots`` and not negative (when ``num_slots`` is given). Each fault has one
    message, wherever it is found (TieredCache, an IO backend), and the offending value
    as ``.value``. The tensor stays on its device.
    """
    if not isinstance(device_slots, torch.Tensor):
        raise TransferError(
            "device_slots must be an int64 torch.Tensor (1-D, one token slot per entry), "
            f"got {type(device_slots).__name__}",
            value=device_slots,
        )
    if (
        device_slots.dtype.is_floating_point
        or device_slots.dtype.is_complex
        or (device_slots.dtype == torch.bool)
    ):
        raise TransferError(
            f"device_slots must hold integers, got {device_slots.dtype}",
            value=device_slots.dtype,
        )
    if device_slots.dim() != 1:
        raise TransferError(
            f"device_slots must be 1-D, got shape {tuple(device_slots.shape)}",
            value=tuple(device_slots.shape),
        )
    if pages is not None and device_slots.numel() != pages * page_size:
        expected = pages * page_size
        raise TransferError(
            f"{device_slots.numel()} device slots for {pages} pages; expected {expected} "
            f"(= pages x page_size {page_size}): pass {expected}",
            value=device_slots.numel(),
        )
    slots = device_slots.to(torch.int64)
    if num_slots is not None:
        check_slots_in_range(slots, num_slots)
    return slots


def check_slots_in_range(slots: torch.Tensor, num_slots: int) -> None:
    """:func:`check_device_slots`' range rule alone: every slot in ``0..num_slots-1``.

    For a caller that checked the tensor itself earlier and now checks the part it uses
    (TieredCache's load: only the slots of the pages it loads).
    """
    if slots.numel():
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= num_slots:
            bad = low if low < 0 else high
            position = int((slots == bad).nonzero()[0, 0])
            raise TransferError(
                f"device slot {bad} is out of range (position {position} of the slots): "
                f"the device pool has slots 0..{num_slots - 1}",
                value=bad,
            )


def check_layer(layer: object, num_layers: int) -> int:
    """The one layer check: ``layer`` if it is an int in ``0..num_layers-1``; else TransferError."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise TransferError(
            f"layer {layer!r} is out of range: the geometry has layers 0..{num_layers - 1}",
            value=layer,
        )
    return layer


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as the widest plain type its last dim allows.

    Copies and index ops never do arithmetic, so any dtype moves bit-exactly (float8 and
    NaN payloads included). 16-byte ``complex128`` elements make CPU ``index_copy_`` and
    ``index_select`` about 1.5x faster than 8-byte ones; the tests check bit-exactness on
    random bytes for every width used.
    """
    raw = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
    width = raw.shape[-1]
    for dtype, size in (
        (torch.complex128, 16),
        (torch.int64, 8),
        (torch.int32, 4),
        (torch.int16, 2),
    ):
        if width % size == 0:
            try:
                return raw.view(dtype)
            except RuntimeError:  # strides or offset not divisible: try a narrower type
                continue
    return raw


class _Chunk(NamedTuple):
    """Pages a staged crossing moves in one device block (:meth:`IOBackend.staged_copies`)."""

    pages: int
    #: Runs of consecutive host pages: (position in the chunk, first host page, length).
    runs: list[tuple[int, int, int]]
    #: The chunk's first device slot when its slots are one ascending range, else every
    #: slot, on the device.
    where: int | torch.Tensor


def _split_tokens(tensor: torch.Tensor, axis: int, pages: int, page_size: int) -> torch.Tensor:
    """``tensor`` with its token axis ``axis`` split into ``[pages, page_size]`` (a view)."""
    shape, strides = list(tensor.shape), list(tensor.stride())
    shape[axis : axis + 1] = [pages, page_size]
    strides[axis : axis + 1] = [strides[axis] * page_size, strides[axis]]
    return tensor.as_strided(shape, strides, tensor.storage_offset())


def _permutation(source: Sequence[str], target: Sequence[str]) -> list[int]:
    return [list(source).index(axis) for axis in target]


def _stack_layers(buffers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[layers, ...]`` over per-layer buffers that are equally spaced views of one storage."""
    first = buffers[0]
    if len(buffers) == 1:
        return first.unsqueeze(0)
    size = first.element_size()
    step_bytes = buffers[1].data_ptr() - first.data_ptr()
    if step_bytes <= 0 or step_bytes % size:
        return None
    storage = first.untyped_storage().data_ptr()
    for index, buffer in enumerate(buffers):
        if (
            buffer.shape != first.shape
            or buffer.stride() != first.stride()
            or buffer.dtype != first.dtype
            or buffer.device != first.device
            or buffer.untyped_storage().data_ptr() != storage
            or buffer.data_ptr() - first.data_ptr() != index * step_bytes
        ):
            return None
    return first.as_strided(
        (len(buffers), *first.shape),
        (step_bytes // size, *first.stride()),
        first.storage_offset(),
    )


@dataclass
class TransferPlan:
    """A validated, non-empty transfer: what :meth:`IOBackend.run_backup` / ``run_load`` get.

    Every page id, slot and layer is in range and no destination repeats; ``slots`` is
    int64 where the caller had them (host memory, so checking them never waits for a
    device), page ``i`` of ``pages`` holding ``slots[i*ps:(i+1)*ps]``. ``layer`` is None
    for an all-layer operation. ``staged``: the pools are on different devices (a CUDA
    pool), so pages cross in contiguous batches through device memory (see
    :meth:`IOBackend.staged_copies`); ``non_blocking``: those crossings are DMA from or
    to pinned memory and need not hold the calling thread.
    """

    device: DevicePool
    host: HostPool
    slots: torch.Tensor  # int64
    pages: list[int]
    layer: int | None
    device_pages: list[int] | None = None  # set by ``direct``: the device page of each page
    staged: bool = False
    non_blocking: bool = False

    def on_device(self, index: torch.Tensor) -> torch.Tensor:
        """``index`` on the device pool's device (pinned first, so the move does not block)."""
        target = torch.device(self.device.device)
        if index.device == target:
            return index
        if self.non_blocking and index.device.type == "cpu":
            return index.pin_memory().to(target, non_blocking=True)
        return index.to(target)


class IOBackend(ABC):
    """Moves KV pages between a device pool and a host pool of one geometry and layout.

    ``device_slots`` are int64 token slot indices, ``len(host_pages) * page_size`` of
    them: page ``i`` of ``host_pages`` holds ``device_slots[i*ps:(i+1)*ps]``. A call
    returns when the data is in place. Subclasses (plugins included) implement
    :meth:`run_backup` and :meth:`run_load` and may add rules in :meth:`check_slots`;
    the base class validates everything else before they are called.

    ``checked=True`` on :meth:`backup` / :meth:`load` tells the base class that the caller
    already passed ``device_slots`` through :func:`check_device_slots` (count and range
    for this device pool, as int64) and ``layer`` through :func:`check_layer`, as
    TieredCache does; those two checks are then skipped and every other one still runs.
    Called directly, leave it False: nothing reaches an implementation unchecked.

    On a CUDA device pool, ``stream`` (a :class:`~kvtier.core.streams.CopyStream`) queues
    the copies on that stream after ``after`` (default: after the caller's current
    stream) and returns at once with a :class:`~kvtier.core.streams.Fence` to wait on;
    the host pages and the slots must stay as they are until it has passed. Without
    ``stream`` a call returns when the data is in place, as on every other device.
    """

    name = "io"
    #: Take the staged path (:attr:`TransferPlan.staged`) even between pools on one
    #: device: how the CUDA path's batching is tested without a GPU.
    stage_always = False

    def __init__(
        self,
        geometry: KVGeometry,
        layout: Layout | str,
        capabilities: Iterable[Capability] = (),
    ) -> None:
        self.geometry = geometry
        self.layout = check_layout(geometry, layout)
        self.capabilities = frozenset(capabilities)
        # per host pool: (kv, layer) -> raw [page, *native axes] view; views never change
        self._host_views: weakref.WeakKeyDictionary[
            HostPool, dict[tuple[int, int | None], torch.Tensor]
        ] = weakref.WeakKeyDictionary()
        ops = [c for c in self.capabilities if c[:2] == (self.layout, geometry.attention)]
        if not ops:
            raise UnsupportedCombinationError(
                f"IO backend {self.name!r} does not execute layout {self.layout.value!r} "
                f"with {geometry.attention.value.upper()}",
                value=(self.layout, geometry.attention),
                supported=sorted(str(c) for c in self.capabilities),
            )

    # --- public API -----------------------------------------------------------------

    def backup(
        self,
        device: DevicePool,
        host: HostPool,
        device_slots: torch.Tensor,
        host_pages: Sequence[int],
        *,
        layer: int | None = None,
        checked: bool = False,
        stream: CopyStream | None = None,
        after: Fence | None = None,
    ) -> Fence:
        """Copy the KV of ``device_slots`` into ``host_pages`` (one layer, or all)."""
        op = Operation.BACKUP_ALL if layer is None else Operation.BACKUP_LAYER
        plan = self._validate(op, device, host, device_slots, host_pages, layer, checked)
        if plan is None:
            return PASSED
        return self._execute(plan, self.run_backup, stream, after)

    def load(
        self,
        host: HostPool,
        device: DevicePool,
        host_pages: Sequence[int],
        device_slots: torch.Tensor,
        *,
        layer: int | None = None,
        checked: bool = False,
        stream: CopyStream | None = None,
        after: Fence | None = None,
    ) -> Fence:
        """Copy ``host_pages`` into the device pool at ``device_slots`` (one layer, or all)."""
        op = Operation.LOAD_ALL if layer is None else Operation.LOAD_LAYER
        plan = self._validate(op, device, host, device_slots, host_pages, layer, checked)
        if plan is None:
            return PASSED
        return self._execute(plan, self.run_load, stream, after)

    @staticmethod
    def _execute(
        plan: TransferPlan,
        run: Callable[[TransferPlan], None],
        stream: CopyStream | None,
        after: Fence | None,
    ) -> Fence:
        """Run ``plan``: on the calling thread, or queued on a CUDA ``stream``."""
        device = plan.device.device
        if not is_cuda(device):
            run(plan)
            return PASSED
        if stream is None:  # in place when the call returns, as off CUDA
            run(plan)
            done = current_fence(device)
            done.synchronize()
            return PASSED
        with stream.active(current_fence(device) if after is None else after):
            run(plan)
        return stream.fence()

    def supports(self, operation: Operation) -> bool:
        """Whether this backend executes ``operation`` for its layout and attention kind."""
        return Capability(self.layout, self.geometry.attention, operation) in self.capabilities

    # --- for implementations --------------------------------------------------------

    @abstractmethod
    def run_backup(self, plan: TransferPlan) -> None:
        """Device -> host for a validated, non-empty plan."""

    @abstractmethod
    def run_load(self, plan: TransferPlan) -> None:
        """Host -> device for a validated, non-empty plan."""

    def check_slots(self, plan: TransferPlan, operation: Operation) -> None:
        """Slot rules beyond range: a load writes each device slot once (``direct`` adds more)."""
        if operation in (Operation.LOAD_ALL, Operation.LOAD_LAYER):
            ordered = torch.sort(plan.slots).values
            repeated = ordered[1:][ordered[1:] == ordered[:-1]]
            if repeated.numel():
                value = int(repeated[0])
                raise TransferError(
                    f"device slot {value} appears twice in one load; each destination slot "
                    "must be written once",
                    value=value,
                )

    def staged_copies(self, plan: TransferPlan, *, to_host: bool) -> None:
        """Move a staged plan in as few device launches and DMA copies as the pages allow.

        Per kv (over all layers when the device buffers stack, else per layer), for each
        chunk of at most :data:`STAGE_BYTES` of pages:

        - a backup gathers every page's token slots into one contiguous device block
          (one ``index_select``, or a strided view when the slots are one ascending
          range, then one copy into host page order) and copies each run of consecutive
          host pages out of it in one DMA;
        - a load copies each run of consecutive host pages into one device block in one
          DMA and scatters the block in one launch (``index_copy_``, or a strided copy
          when the slots are one range).

        So a chunk costs one or two launches and one DMA per run of host pages, whatever
        the engine's block table looks like. Where a run over all layers is not one
        contiguous host block (``layer_first``), the pages cross layer by layer. Both
        built-in IO backends take this path across devices (a CUDA pool).
        """
        ps = self.geometry.page_size
        rows = plan.slots.view(-1, ps)
        # a DMA needs a contiguous host block: where a run of pages over all layers is not
        # one (layer_first, padded pages), the pages cross layer by layer
        whole = self._host_pages(plan.host, 0, None)[:2].is_contiguous()
        page = self._host_pages(plan.host, 0, None if whole else 0)[0]
        per_chunk = max(1, STAGE_BYTES // (page.numel() * page.element_size()))
        chunks: list[_Chunk] = []
        for c0 in range(0, len(plan.pages), per_chunk):
            part = rows[c0 : c0 + per_chunk]
            start = _slot_range(part)
            chunks.append(
                _Chunk(
                    part.shape[0],
                    _page_runs(plan.pages[c0 : c0 + per_chunk]),
                    start if start is not None else plan.on_device(part.reshape(-1)),
                )
            )
        move = self._stage_out if to_host else self._stage_in
        for layer, device_views in self._device_views(plan, by_layer=not whole):
            token_axis = self._native_axes(layer).index("token")
            for kv, dev in enumerate(device_views):
                host_view = self._host_pages(plan.host, kv, layer)
                for chunk in chunks:
                    move(plan, dev, host_view, token_axis, chunk)

    def _stage_out(
        self,
        plan: TransferPlan,
        dev: torch.Tensor,
        host_view: torch.Tensor,
        token_axis: int,
        chunk: _Chunk,
    ) -> None:
        """Device -> host for one chunk: one gather into page order, one DMA per host run."""
        ps, count, where = self.geometry.page_size, chunk.pages, chunk.where
        if isinstance(where, int):
            source = dev.narrow(token_axis, where, count * ps)
        else:
            source = dev.index_select(token_axis, where)
        pages = _split_tokens(source, token_axis, count, ps).movedim(token_axis, 0)
        if not pages.is_contiguous():
            pages = pages.contiguous()  # [count, *native axes]: each run one block
        for i0, h0, n in chunk.runs:
            host_view[h0 : h0 + n].copy_(pages[i0 : i0 + n], non_blocking=plan.non_blocking)

    def _stage_in(
        self,
        plan: TransferPlan,
        dev: torch.Tensor,
        host_view: torch.Tensor,
        token_axis: int,
        chunk: _Chunk,
    ) -> None:
        """Host -> device for one chunk: one DMA per host run into a block, one scatter."""
        ps, count, where = self.geometry.page_size, chunk.pages, chunk.where
        block = torch.empty((count, *host_view.shape[1:]), dtype=host_view.dtype, device=dev.device)
        for i0, h0, n in chunk.runs:
            block[i0 : i0 + n].copy_(host_view[h0 : h0 + n], non_blocking=plan.non_blocking)
        tokens = block.movedim(0, token_axis)  # [..., count, ps, ...] in device axis order
        if isinstance(where, int):
            target = dev.narrow(token_axis, where, count * ps)
            _split_tokens(target, token_axis, count, ps).copy_(tokens)
        else:
            dev.index_copy_(token_axis, where, tokens.flatten(token_axis, token_axis + 1))

    # --- validation -----------------------------------------------------------------

    def _validate(
        self,
        operation: Operation,
        device: DevicePool,
        host: HostPool,
        device_slots: Any,
        host_pages: Any,
        layer: Any,
        checked: bool,
    ) -> TransferPlan | None:
        g = self.geometry
        if not self.supports(operation):
            raise TransferError(
                f"IO backend {self.name!r} does not execute {operation.value} for "
                f"{self.layout.value}/{g.attention.value}; it executes: "
                f"{', '.join(sorted(str(c) for c in self.capabilities))}",
                value=operation,
            )
        if layer is not None and not checked:
            check_layer(layer, g.num_layers)
        if not isinstance(host, HostPool):
            raise TransferError(
                f"host must be a kvtier HostPool, got {type(host).__name__}", value=host
            )
        for what, geometry in (("device pool", device.geometry), ("host pool", host.geometry)):
            if geometry != g:
                raise TransferError(
                    f"{what} geometry {geometry.describe()} differs from the IO backend's "
                    f"{g.describe()}",
                    value=geometry,
                )
        if host.layout is not self.layout:
            raise TransferError(
                f"host pool layout {host.layout.value!r} differs from the IO backend's "
                f"{self.layout.value!r}; build the IO backend for the pool's layout",
                value=host.layout,
            )
        pages = self._pages(host, host_pages)
        if checked:  # the caller ran check_device_slots for this device pool
            slots = device_slots
        else:
            slots = check_device_slots(
                device_slots,
                page_size=g.page_size,
                pages=len(pages),
                num_slots=device.num_slots,
            )
        if not pages:
            return None
        is_backup = operation in (Operation.BACKUP_ALL, Operation.BACKUP_LAYER)
        if is_backup and len(set(pages)) != len(pages):
            duplicate = next(p for p, n in _counts(pages).items() if n > 1)
            raise TransferError(
                f"host page {duplicate} appears twice in one backup; each destination "
                "page must be written once",
                value=duplicate,
            )
        across = torch.device(device.device) != host.kv_buffers[0].device
        plan = TransferPlan(
            device,
            host,
            slots,
            pages,
            layer,
            staged=across or self.stage_always,
            non_blocking=across and host.pin_memory,
        )
        self.check_slots(plan, operation)
        return plan

    @staticmethod
    def _pages(host: HostPool, host_pages: Any) -> list[int]:
        if isinstance(host_pages, torch.Tensor):
            if host_pages.dtype.is_floating_point or host_pages.dtype == torch.bool:
                raise TransferError(
                    f"host_pages must hold integers, got a {host_pages.dtype} tensor",
                    value=host_pages.dtype,
                )
            host_pages = host_pages.reshape(-1).tolist()
        try:
            pages = list(host_pages)
        except TypeError:
            raise TransferError(
                f"host_pages must be a sequence of page ids, got {type(host_pages).__name__}",
                value=host_pages,
            ) from None
        for page in pages:
            check_host_page(page, host.num_pages, error=TransferError)
        return pages

    # --- views shared by implementations --------------------------------------------

    def _host_pages(self, host: HostPool, kv: int, layer: int | None) -> torch.Tensor:
        """Host memory of one kv as ``[page, *native axes]`` (layer axis dropped if given)."""
        views = self._host_views.get(host)
        if views is None:
            views = self._host_views.setdefault(host, {})
        view = views.get((kv, layer))
        if view is None:
            view = views[(kv, layer)] = self._build_host_pages(host, kv, layer)
        return view

    def _build_host_pages(self, host: HostPool, kv: int, layer: int | None) -> torch.Tensor:
        view = page_view(_raw(host.kv_buffers[kv]), self.geometry, self.layout)
        if layer is not None:
            view = view.select(1 + page_axes(self.layout).index("layer"), layer)
        return view

    def _native_axes(self, layer: int | None) -> tuple[str, ...]:
        return page_axes(self.layout, without_layer=layer is not None)

    def _device_views(
        self, plan: TransferPlan, *, by_layer: bool = False
    ) -> list[tuple[int | None, list[torch.Tensor]]]:
        """Device memory per kv in host-native axis order, as (layer, [tensor per kv]).

        One entry covering all layers when the pool's layer buffers stack (and not
        ``by_layer``), else one per layer.
        """
        g = self.geometry
        layers = range(g.num_layers) if plan.layer is None else [plan.layer]
        per_layer = [layer_buffers(plan.device, layer) for layer in layers]
        if plan.layer is None and not by_layer:
            stacked = [_stack_layers([bufs[kv] for bufs in per_layer]) for kv in range(g.kv_count)]
            if all(s is not None for s in stacked):
                perm = _permutation(_DEVICE_AXES, self._native_axes(None))
                return [(None, [_raw(s).permute(perm) for s in stacked if s is not None])]
        axes = self._native_axes(0)
        perm = _permutation(_DEVICE_AXES[1:], axes)
        return [
            (layer, [_raw(buf).permute(perm) for buf in bufs])
            for layer, bufs in zip(layers, per_layer, strict=True)
        ]


def _counts(values: Iterable[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


@functools.lru_cache(maxsize=16)
def _page_offsets(page_size: int, device: torch.device) -> torch.Tensor:
    """``arange(page_size)`` on ``device``, made once (``direct``'s whole-page rule)."""
    return torch.arange(page_size, device=device)


def _page_runs(host_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Consecutive host pages as (position in ``host_pages``, first page, length) runs."""
    runs: list[tuple[int, int, int]] = []
    for i, page in enumerate(host_pages):
        if runs:
            i0, h0, n = runs[-1]
            if page == h0 + n:
                runs[-1] = (i0, h0, n + 1)
                continue
        runs.append((i, page, 1))
    return runs


def _slot_range(rows: torch.Tensor) -> int | None:
    """The first slot when ``rows`` (pages x page_size) is one ascending range, else None."""
    flat = rows.reshape(-1)
    if flat.numel() > 1 and not bool((flat[1:] - flat[:-1] == 1).all()):
        return None
    return int(flat[0])


def _runs(host_pages: Sequence[int], device_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce pairs into (host_start, device_start, length) runs of consecutive pages."""
    runs: list[tuple[int, int, int]] = []
    for h, d in zip(host_pages, device_pages, strict=True):
        if runs:
            h0, d0, n = runs[-1]
            if h == h0 + n and d == d0 + n:
                runs[-1] = (h0, d0, n + 1)
                continue
        runs.append((h, d, 1))
    return runs


class DirectIOBackend(IOBackend):
    """Page-granular copies: each page's slots must be one whole, aligned device page."""

    name = "direct"

    def check_slots(self, plan: TransferPlan, operation: Operation) -> None:
        """Each page's slots must be one whole device page; loads may not repeat a page."""
        ps = self.geometry.page_size
        rows = plan.slots.view(-1, ps)
        starts = rows[:, :1]
        bad = (rows != starts + _page_offsets(ps, rows.device)).any(1) | (starts[:, 0] % ps != 0)
        if bool(bad.any()):
            index = int(bad.nonzero()[0, 0])
            got = rows[index].tolist()
            raise TransferError(
                f"IO backend 'direct' moves whole device pages, but page {index} of the batch "
                f"has slots {got[:8]}{'...' if ps > 8 else ''}; each page needs page_size "
                f"({ps}) consecutive slots starting at a multiple of {ps}. Use the 'kernel' "
                "IO backend for token-granular slots",
                value=got,
            )
        device_pages = (starts[:, 0] // ps).tolist()
        if operation in (Operation.LOAD_ALL, Operation.LOAD_LAYER) and len(
            set(device_pages)
        ) != len(device_pages):
            value = next(p for p, n in _counts(device_pages).items() if n > 1) * ps
            raise TransferError(
                f"device slot {value} appears twice in one load (device page {value // ps} "
                "is listed twice); each destination slot must be written once",
                value=value,
            )
        plan.device_pages = device_pages

    def _copy(self, plan: TransferPlan, to_host: bool) -> None:
        """One op per kv for each run of pages (see :meth:`_moves`)."""
        ps = self.geometry.page_size
        assert plan.device_pages is not None
        moves: list[tuple[int, int, int | torch.Tensor]] | None = None
        for layer, device_views in self._device_views(plan):
            axis = self._native_axes(layer).index("token")
            for kv, dev in enumerate(device_views):
                host_view = self._host_pages(plan.host, kv, layer)
                if moves is None:
                    moves = self._moves(plan, layer)
                usable = (dev.shape[axis] // ps) * ps
                shape = list(dev.shape)
                shape[axis : axis + 1] = [usable // ps, ps]
                dev_pages = dev.narrow(axis, 0, usable).view(shape).movedim(axis, 0)
                for h0, n, where in moves:
                    host_run = host_view[h0 : h0 + n]
                    if isinstance(where, int):  # device pages where .. where + n - 1
                        if to_host:
                            host_run.copy_(dev_pages[where : where + n])
                        else:
                            dev_pages[where : where + n].copy_(host_run)
                    elif to_host:  # one gather (index_select would copy page by page)
                        torch.ops.aten.index.Tensor_out(dev_pages, [where], out=host_run)
                    else:
                        dev_pages.index_copy_(0, where, host_run)

    def _moves(
        self, plan: TransferPlan, layer: int | None
    ) -> list[tuple[int, int, int | torch.Tensor]]:
        """(first host page, pages, first device page or the device pages) per op.

        Pages consecutive on both sides are one strided ``copy_``. A run of consecutive
        host pages whose device pages are not consecutive (an engine's block table) is,
        where the host page keeps each slot's heads x dim
        row whole, as the device does (every layout but ``page_head``), one gather /
        ``index_copy_`` along the page axis rather than a ``copy_`` per page. Each CPU op
        forks and joins torch's intra-op threads, and on a small VM a join often waited
        7-15 ms for the other vCPU's thread to wake, whatever the op's size: 16 shuffled
        8 MiB pages took 230-250 ms copied page by page against 16-34 ms in one op per kv;
        with one thread the gather costs 1.0-1.4x the copies (``benchmarks/io.py``,
        ``pages`` slots). ``page_head``'s rows are one head's ``dim`` values, which the
        index kernels move up to 2x slower than ``copy_`` does, so its copies stay per
        page. (Across devices, a CUDA pool, plans take :meth:`IOBackend.staged_copies`.)
        """
        assert plan.device_pages is not None
        whole_rows = self._native_axes(layer)[-2:] == ("head", "dim")
        if not whole_rows:
            return [(h0, n, d0) for h0, d0, n in _runs(plan.pages, plan.device_pages)]
        moves: list[tuple[int, int, int | torch.Tensor]] = []
        for i0, h0, n in _page_runs(plan.pages):
            run = plan.device_pages[i0 : i0 + n]
            if all(d == run[0] + k for k, d in enumerate(run)):
                moves.append((h0, n, run[0]))
            else:
                where = torch.tensor(run, dtype=torch.int64, device=plan.slots.device)
                moves.append((h0, n, where))
        return moves

    def run_backup(self, plan: TransferPlan) -> None:
        if plan.staged:
            self.staged_copies(plan, to_host=True)
        else:
            self._copy(plan, to_host=True)

    def run_load(self, plan: TransferPlan) -> None:
        if plan.staged:
            self.staged_copies(plan, to_host=False)
        else:
            self._copy(plan, to_host=False)


class KernelIOBackend(IOBackend):
    """Token-granular gather/scatter with ``index_select`` / ``index_put_``; any slots.

    Runs of consecutive host pages whose slots are one range are strided copies (one per
    kv). Otherwise backup gathers each host page straight into host memory
    (``index_select(out=page)``) where the page block is contiguous; ``layer_first``
    gathers layer by layer (its page is contiguous per layer) and ``page_head`` gathers in
    device order into a small scratch tensor first (a strided ``index_select`` into its
    head-major order is ~50x slower on CPU); load scatters each run of consecutive host
    pages with one ``index_put_`` per kv (see :meth:`run_load`).
    """

    name = "kernel"

    def run_backup(self, plan: TransferPlan) -> None:
        """Gather the pages; a run of consecutive host pages whose slots are one ascending
        range (the usual case) is one strided ``copy_`` per kv, any other page a gather
        of its own (see :meth:`run_load` for why few, large ops matter). Across devices
        (a CUDA pool): :meth:`IOBackend.staged_copies`."""
        if plan.staged:
            self.staged_copies(plan, to_host=True)
            return
        ps = self.geometry.page_size
        rows = plan.slots.view(-1, ps)
        chunks = rows.unbind(0)
        runs = _page_runs(plan.pages)
        contiguous: list[int | None] | None = None  # each run's first slot, if a range
        for layer, device_views in self._device_views(plan):
            axes = self._native_axes(layer)
            token_axis = axes.index("token")
            for kv, dev in enumerate(device_views):
                host_view = self._host_pages(plan.host, kv, layer)
                if contiguous is None:
                    contiguous = [_slot_range(rows[i0 : i0 + n]) for i0, _, n in runs]
                todo: list[int] = []
                for (i0, h0, n), start in zip(runs, contiguous, strict=True):
                    if start is None:
                        todo.extend(range(i0, i0 + n))
                        continue
                    source = dev.narrow(token_axis, start, n * ps)
                    shape = list(source.shape)
                    shape[token_axis : token_axis + 1] = [n, ps]
                    host_view[h0 : h0 + n].movedim(0, token_axis).copy_(source.view(shape))
                if self.layout is Layout.PAGE_HEAD:
                    # gather in the device's own axis order, then permute into head-major
                    natural_axes = [a for a in _DEVICE_AXES if a in axes]
                    natural = dev.permute(_permutation(axes, natural_axes))
                    back = _permutation(natural_axes, axes)
                    natural_token = natural_axes.index("token")
                    for i in todo:
                        gathered = natural.index_select(natural_token, chunks[i])
                        host_view[plan.pages[i]].copy_(gathered.permute(back))
                    continue
                per_layer = layer is None and self.layout is Layout.LAYER_FIRST
                for i in todo:
                    target, index = host_view[plan.pages[i]], chunks[i]
                    if per_layer:
                        for sub_target, sub_dev in zip(target, dev, strict=True):
                            torch.index_select(sub_dev, 0, index, out=sub_target)
                    elif target.is_contiguous():
                        torch.index_select(dev, token_axis, index, out=target)
                    else:
                        target.copy_(dev.index_select(token_axis, index))

    def run_load(self, plan: TransferPlan) -> None:
        """Scatter each run of consecutive host pages with one op per kv (and layer view).

        A run whose slots are one ascending range is a strided ``copy_``; any other run
        one ``index_put_`` of all its pages. Few, large ops matter on a CPU device: a
        per-page ``index_copy_`` runs on torch's intra-op threads, and on a shared host
        each of those calls waits for its slowest thread, so loads swung 0.3-10 GB/s
        between calls while backups held steady. Across devices (a CUDA pool):
        :meth:`IOBackend.staged_copies`.
        """
        if plan.staged:
            self.staged_copies(plan, to_host=False)
            return
        ps = self.geometry.page_size
        rows = plan.slots.view(-1, ps)
        runs = _page_runs(plan.pages)
        contiguous: list[int | None] | None = None  # each run's first slot, if a range
        for layer, device_views in self._device_views(plan):
            token_axis = self._native_axes(layer).index("token")
            lead: tuple[slice | torch.Tensor, ...] = (slice(None),) * token_axis
            for kv, dev in enumerate(device_views):
                host_view = self._host_pages(plan.host, kv, layer)
                if contiguous is None:
                    contiguous = [_slot_range(rows[i0 : i0 + n]) for i0, _, n in runs]
                for (i0, h0, n), start in zip(runs, contiguous, strict=True):
                    source = host_view[h0 : h0 + n].movedim(0, token_axis)
                    if start is not None:
                        target = dev.narrow(token_axis, start, n * ps)
                        shape = list(target.shape)
                        shape[token_axis : token_axis + 1] = [n, ps]
                        target.view(shape).copy_(source)
                    else:
                        where = (*lead, rows[i0 : i0 + n])
                        dev[where] = source


def _make_direct(config: Any, geometry: KVGeometry, layout: Layout | str) -> DirectIOBackend:
    return DirectIOBackend(geometry, layout, DIRECT_SPEC.capabilities)


def _make_kernel(config: Any, geometry: KVGeometry, layout: Layout | str) -> KernelIOBackend:
    return KernelIOBackend(geometry, layout, KERNEL_SPEC.capabilities)


DIRECT_SPEC = IOBackendSpec(
    name="direct",
    factory=_make_direct,
    config_model=EmptyConfig,
    description="page-granular strided copies; each page's slots must be one aligned device page",
    capabilities=full_matrix(),
    priority=10,
)

KERNEL_SPEC = IOBackendSpec(
    name="kernel",
    factory=_make_kernel,
    config_model=EmptyConfig,
    description="token-granular gather/scatter (index_select / index_copy_); any slots",
    capabilities=full_matrix(),
    priority=20,
)


def capability_table(specs: Iterable[IOBackendSpec]) -> str:
    """A Markdown table: which IO backends execute each (layout, attention, operation)."""
    specs = sorted(specs, key=lambda s: s.name)
    ops = list(Operation)
    lines = [
        "| layout | attention | " + " | ".join(op.value for op in ops) + " |",
        "|---|---|" + "---|" * len(ops),
    ]
    for layout, attention in itertools.product(Layout, AttentionKind):
        cells = []
        for op in ops:
            names = [s.name for s in specs if s.supports(layout, attention, op)]
            cells.append(", ".join(names) if names else "—")
        lines.append(f"| {layout.value} | {attention.value} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
