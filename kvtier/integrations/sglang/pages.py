"""SGLang's host pools seen as kvtier pages: in place where SGLang names the memory.

:class:`SGLangPages` serves a materialized MHA/MLA host pool (SGLang's ``kv_buffer``: the KV
pool, an SWA pool) to a :class:`~kvtier.core.pagestore.PageStore` with no copy;
:class:`SlotPages` serves a state pool (Mamba) in place through the runs its
``get_page_buffer_meta`` names; :class:`StatePages` moves a state pool that names none by
value, one flat page (SGLang's ``get_data_page``) at a time; :func:`flat_page` checks a
caller's page tensor on SGLang's generic path. :class:`HeadSlicePages` serves one head slice
of each page, for SGLang's heterogeneous tensor parallelism (``tp_lcm_size``).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import (
    InvalidFieldError,
    PageError,
    TransferError,
    UnsupportedCombinationError,
)
from kvtier.core.extents import Extent, copy_extents
from kvtier.core.geometry import AttentionKind, KVGeometry, dtype_from_name, dtype_name
from kvtier.core.host_pool import aligned_empty
from kvtier.core.layout import Layout, layouts_for

__all__ = [
    "SPARE_BYTES",
    "HeadSlicePages",
    "SGLangPages",
    "SlotPages",
    "StatePages",
    "flat_page",
    "in_place_refusal",
    "page_ids",
    "pool_geometry_fields",
    "pool_layout",
    "unsupported_pool",
]

#: kvtier's own flat pages for staged gets, per pool: one slab of at most this many bytes
#: (a larger get takes fresh tensors for the rest).
SPARE_BYTES = 256 << 20

# --- the host pool, seen as kvtier pages ---------------------------------------------------


def _extent_at(address: int, length: int) -> Extent:
    """A writable extent over ``length`` bytes of process memory at ``address``."""
    view = memoryview((ctypes.c_ubyte * length).from_address(address)).cast("B")
    return Extent(view, address, length)


def _runs(view: torch.Tensor) -> list[tuple[int, int]]:
    """``(address, bytes)`` of the contiguous runs of a strided view, in C order."""
    shape, stride = list(view.shape), list(view.stride())
    k, block = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or stride[k - 1] == block):
        block *= shape[k - 1]
        k -= 1
    item = view.element_size()
    base = view.data_ptr()
    return [
        (base + item * sum(i * s for i, s in zip(index, stride[:k], strict=True)), block * item)
        for index in itertools.product(*(range(n) for n in shape[:k]))
    ]


def unsupported_pool(pool: Any, what: str) -> UnsupportedCombinationError:
    return UnsupportedCombinationError(
        f"SGLang host pool {type(pool).__name__}: {what}; kvtier stores the KV pages of "
        "materialized MHA/MLA host pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost)",
        value=type(pool).__name__,
        supported=[
            f"--hicache-mem-layout {layout.value} with a plain MHA/GQA or MLA model"
            for layout in Layout
        ],
    )


def pool_layout(pool: Any, attention: AttentionKind) -> Layout:
    """The kvtier layout of an SGLang host pool, or an error listing the ones that work."""
    name = getattr(pool, "layout", None)
    allowed = layouts_for(attention)
    try:
        layout = Layout(name)
    except ValueError:
        layout = None
    if layout is None or layout not in allowed:
        raise UnsupportedCombinationError(
            f"SGLang host-pool layout {name!r} has no kvtier equivalent for "
            f"{attention.value.upper()}",
            value=name,
            supported=[f"--hicache-mem-layout {item.value}" for item in allowed],
        )
    return layout


def _pool_dtype(pool: Any, override: str | None) -> torch.dtype:
    stored = pool.dtype
    try:
        native: torch.dtype | None = dtype_from_name(stored)
    except InvalidFieldError:
        native = None
    if override is None:
        if native is None:
            raise InvalidFieldError(
                "kvtier.dtype",
                f"SGLang's host pool stores KV as {stored}, which names no KV dtype; set "
                '"dtype" in the kvtier section to the KV cache dtype (for fp8 KV: '
                '"float8_e4m3fn" or "float8_e5m2")',
                value=str(stored),
            )
        return native
    wanted = dtype_from_name(override)
    if native is not None and native != wanted:
        raise InvalidFieldError(
            "kvtier.dtype",
            f"is {override!r} but SGLang's host pool holds {dtype_name(native)}; "
            "leave dtype out (it is only for pools that store raw bytes)",
            value=override,
        )
    itemsize = torch.empty((), dtype=stored).element_size()
    if torch.empty((), dtype=wanted).element_size() != itemsize:
        raise InvalidFieldError(
            "kvtier.dtype",
            f"{override!r} is not {itemsize} byte(s) per element like the pool's {stored}",
            value=override,
        )
    return wanted


def pool_geometry_fields(
    pool: Any, attention: AttentionKind, dtype_override: str | None = None
) -> dict[str, Any]:
    """The engine-config geometry fields of an SGLang MHA or MLA host pool (this rank's share).

    MLA: kvtier's geometry keeps only the latent's width (``kv_cache_dim``, which SGLang
    may override, e.g. for fp8 NSA); it is split as SGLang splits it when the pool says
    so, and any split names the same pages.
    """
    try:
        dtype = dtype_name(_pool_dtype(pool, dtype_override))
        fields: dict[str, Any] = {
            "dtype": dtype,
            "num_layers": int(pool.layer_num),
            "page_size": int(pool.page_size),
        }
        if attention is AttentionKind.MLA:
            rope = int(getattr(pool, "qk_rope_head_dim", 0) or 0)
            dim = int(getattr(pool, "kv_cache_dim", None) or (int(pool.kv_lora_rank) + rope))
            if not 0 < rope < dim:
                rope = dim // 2
            return {**fields, "kv_lora_rank": dim - rope, "qk_rope_head_dim": rope}
        heads, head_dim = int(pool.head_num), int(pool.head_dim)
    except AttributeError as exc:
        raise unsupported_pool(pool, f"it has no attribute {exc.name!r}") from None
    v_head_dim = int(getattr(pool, "v_head_dim", head_dim))
    if v_head_dim != head_dim:
        raise unsupported_pool(pool, f"K and V head sizes differ ({head_dim} and {v_head_dim})")
    return {**fields, "num_kv_heads": heads, "head_dim": head_dim}


def page_ids(host_indices: Any, count: int, ps: int, num_pages: int) -> list[int]:
    """Host page ids of ``count`` pages from SGLang's token indices (``ps`` per key)."""
    idx = torch.as_tensor(host_indices).reshape(-1)
    if idx.numel() != count * ps:
        raise PageError(
            f"got {idx.numel()} host indices for {count} keys; SGLang passes "
            f"page_size ({ps}) token indices per key",
            value=idx.numel(),
        )
    if count == 0:
        return []
    rows = idx.to(device="cpu", dtype=torch.int64).reshape(count, ps)
    first = rows[:, 0]
    bad = (first % ps != 0) | (first < 0) | (first + ps > num_pages * ps)
    if ps > 1:
        bad |= (rows - first[:, None] != torch.arange(ps)).any(dim=1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise PageError(
            f"host indices of key {row} ({rows[row, :4].tolist()}...) are not one whole "
            f"page: page_size ({ps}) consecutive tokens starting at a multiple of "
            f"{ps} below {num_pages * ps}",
            value=rows[row].tolist(),
        )
    return [int(i) for i in (first // ps).tolist()]


def flat_page(tensor: Any, pages: SGLangPages, *, writable: bool) -> torch.Tensor:
    """A caller's flat page tensor (SGLang's generic path), checked to hold one of
    ``pages``' host pages (:attr:`SGLangPages.page_bytes`).

    A strided tensor is copied for a put; a get fills the tensor in place, so it must be
    contiguous.
    """
    geometry = pages.geometry
    expected = pages.page_bytes
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise TransferError(
            f"expected a CPU tensor holding one page, got {type(tensor).__name__}",
            value=type(tensor).__name__,
        )
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes != expected:
        raise TransferError(
            f"a page tensor of {nbytes} bytes cannot hold a host page of "
            f"{geometry.describe()}{pages.slice_note}; it takes {expected} bytes",
            value=nbytes,
        )
    if tensor.is_contiguous():
        return tensor
    if writable:
        raise TransferError(
            "legacy get fills the target tensor in place, so it must be contiguous",
            value=tuple(tensor.stride()),
        )
    return tensor.contiguous()


def _whole_run(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """``(address, bytes)`` of a contiguous tensor: one run."""
    return [(tensor.data_ptr(), tensor.numel() * tensor.element_size())]


class _Registered:
    """Flat page tensors registered as pages for the calls that move them, ids counting
    up from ``first``: each with a 4096-aligned envelope slot (in a slab of the
    registration, unless the caller names one) and its payload runs, the tensor kept
    alive until :meth:`drop`."""

    def __init__(self, first: int) -> None:
        self._pages: dict[int, tuple[Extent, ...]] = {}
        self._keep: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._ids = itertools.count(first)
        self._lock = threading.Lock()

    def add(
        self,
        tensors: Sequence[torch.Tensor],
        runs: Callable[[torch.Tensor], list[tuple[int, int]]] = _whole_run,
        slot: Callable[[torch.Tensor], int | None] = lambda tensor: None,
    ) -> list[int]:
        """Register ``tensors``, ``runs`` naming each one's payload and ``slot`` the
        address of an envelope slot it already has (None: a new one); returns their ids."""
        slab = aligned_empty(len(tensors) * ENVELOPE_BYTES)[1]
        ids = []
        with self._lock:
            for i, tensor in enumerate(tensors):
                page = next(self._ids)
                at = slot(tensor)
                start = slab.data_ptr() + i * ENVELOPE_BYTES if at is None else at
                payload = [_extent_at(a, n) for a, n in runs(tensor)]
                self._pages[page] = (_extent_at(start, ENVELOPE_BYTES), *payload)
                self._keep[page] = (slab, tensor)
                ids.append(page)
        return ids

    def get(self, page: int) -> tuple[Extent, ...] | None:
        """``(envelope slot, *payload)`` of a registered page, else None."""
        return self._pages.get(page)

    def drop(self, ids: Sequence[int]) -> None:
        """Forget pages once no call uses them any more (their call returned)."""
        with self._lock:
            for page in ids:
                self._pages.pop(page, None)
                self._keep.pop(page, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pages)


class _InPlacePages:
    """What both in-place views of an SGLang pool share: the envelope slab, page ids and
    scratch pages.

    Page ``p`` covers the pool's slots ``[p * page_size, (p + 1) * page_size)``; its
    envelope header lives in a 4096-aligned slot of a slab kvtier owns (untouched slots
    cost no memory), its payload in the pool's own memory, as the subclass names it.
    Ids from ``num_pages`` up are scratch pages: flat page tensors (a caller's on the
    generic path, or kvtier's own for a staged get), each with an envelope slot of its
    own; a scratch page keeps its tensor alive until :meth:`drop_scratch`.
    """

    #: What the pool is called in errors: "host" (the KV pool) or "state".
    kind = "host"

    def __init__(self, pool: Any) -> None:
        self.host_pool = pool
        self.page_size = int(pool.page_size)
        self.num_pages = int(pool.size) // self.page_size
        #: One ENVELOPE_BYTES slot per page.
        self._headers = aligned_empty(self.num_pages * ENVELOPE_BYTES)[1]
        self._header_cache: dict[int, Extent] = {}
        self._extent_cache: dict[int, tuple[Extent, ...]] = {}
        self._scratch = _Registered(self.num_pages)
        #: kvtier's own flat pages for staged gets (one slab, allocated on first use and
        #: registered with backends that need registered memory), and its free slots.
        self._slab: torch.Tensor | None = None
        self._spare_free: list[int] = []
        self._lock = threading.Lock()

    def _header_slab(self) -> Extent:
        return _extent_at(self._headers.data_ptr(), self._headers.numel())

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise PageError(
                f"{self.kind} page {page} is out of range: the SGLang {self.kind} pool has "
                f"pages 0..{self.num_pages - 1}",
                value=page,
            )

    @property
    def page_bytes(self) -> int:
        """Bytes of one whole flat page (SGLang's flat data page)."""
        raise NotImplementedError

    def extents(self, page: int) -> list[Extent]:
        """The page's payload regions in the pool, in flat-data-page order (a scratch
        page's own), checked once and cached, since the pool never moves."""
        scratch = self._scratch_extents(page)
        if scratch is not None:
            return scratch
        cached = self._extent_cache.get(page)
        if cached is None:
            self._check_page(page)
            runs = self._page_runs(page)
            cached = self._extent_cache[page] = tuple(_extent_at(a, n) for a, n in runs)
        return list(cached)

    def _page_runs(self, page: int) -> list[tuple[int, int]]:
        """``(address, bytes)`` of page ``page``'s payload in the pool (``page`` is in
        range), checked to lie in the pool's memory and to make a whole page."""
        raise NotImplementedError

    def header_extent(self, page: int) -> Extent:
        """The page's 4096-aligned envelope slot (a scratch page's own)."""
        scratch = self._scratch.get(page)
        if scratch is not None:
            return scratch[0]
        cached = self._header_cache.get(page)
        if cached is None:
            self._check_page(page)
            start = self._headers.data_ptr() + page * ENVELOPE_BYTES
            cached = self._header_cache[page] = _extent_at(start, ENVELOPE_BYTES)
        return cached

    def page_buffers(self, page: int) -> list[Extent]:
        """``[header_extent(page), *extents(page)]``: what the backend stores."""
        return [self.header_extent(page), *self.extents(page)]

    def pages_of(self, host_indices: Any, count: int) -> list[int]:
        """Page ids of ``count`` pages from SGLang's slot indices (page_size per key)."""
        return page_ids(host_indices, count, self.page_size, self.num_pages)

    # --- scratch pages ----------------------------------------------------------------------

    def scratch_runs(self, tensor: torch.Tensor) -> list[tuple[int, int]]:
        """``(address, bytes)`` of what this view stores of a flat page tensor."""
        return _whole_run(tensor)

    def _scratch_extents(self, page: int) -> list[Extent] | None:
        scratch = self._scratch.get(page)
        return None if scratch is None else list(scratch[1:])

    def add_scratch(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """Register flat page tensors as scratch pages (kept alive until
        :meth:`drop_scratch`); returns their ids. A tensor of :meth:`take_spare` keeps
        the envelope slot in front of it in the spare slab; others get a new one."""
        return self._scratch.add(tensors, self.scratch_runs, self._spare_slot)

    def drop_scratch(self, ids: Sequence[int]) -> None:
        """Forget scratch pages once no call uses them any more (the call returned)."""
        self._scratch.drop(ids)

    def scratch_held(self) -> int:
        """Scratch pages registered now (in a call, or held for a late one)."""
        return len(self._scratch)

    def _stride(self) -> int:
        """Bytes of one spare slot: an envelope slot, then the page (4096-aligned)."""
        return ENVELOPE_BYTES + -(-self.page_bytes // 4096) * 4096

    def _slab_locked(self) -> torch.Tensor:
        if self._slab is None:
            slots = max(1, min(self.num_pages, SPARE_BYTES // self._stride()))
            self._slab = aligned_empty(slots * self._stride())[1]
            self._spare_free = list(range(slots))
        return self._slab

    def _spare_slot(self, tensor: torch.Tensor) -> int | None:
        """The address of the envelope slot of a spare slab tensor, else None."""
        slab = self._slab
        if slab is None:
            return None
        offset = tensor.data_ptr() - slab.data_ptr()
        if not 0 <= offset < slab.numel() or offset % self._stride() != ENVELOPE_BYTES:
            return None
        return tensor.data_ptr() - ENVELOPE_BYTES

    def spare_region(self) -> Extent:
        """The slab of kvtier's own flat pages (untouched slots cost no memory)."""
        with self._lock:
            slab = self._slab_locked()
        return _extent_at(slab.data_ptr(), slab.numel())

    def take_spare(self, count: int) -> list[torch.Tensor]:
        """``count`` flat page tensors of kvtier's own, for a staged get: free slots of
        the slab first (registered memory), fresh tensors beyond them."""
        with self._lock:
            slab = self._slab_locked()
            slots, self._spare_free = self._spare_free[:count], self._spare_free[count:]
        size, stride = self.page_bytes, self._stride()
        first = [slot * stride + ENVELOPE_BYTES for slot in slots]
        taken = [slab[at : at + size] for at in first]
        return taken + [torch.empty(size, dtype=torch.uint8) for _ in range(count - len(slots))]

    def give_spare(self, tensors: Sequence[torch.Tensor]) -> None:
        """Hand back tensors of :meth:`take_spare` that no call uses any more (a slab slot
        is free again; a fresh tensor is simply dropped)."""
        with self._lock:
            slab = self._slab
            if slab is None:
                return
            for tensor in tensors:
                if self._spare_slot(tensor) is not None:
                    self._spare_free.append((tensor.data_ptr() - slab.data_ptr()) // self._stride())

    def copy_in(self, scratch: int, page: int) -> None:
        """Copy scratch page ``scratch``'s payload into page ``page`` (the same bytes in the
        same order: what the view stores of one page)."""
        source = self._scratch_extents(scratch)
        if source is None:
            raise PageError(f"scratch page {scratch} is not registered", value=scratch)
        copy_extents(source, self.extents(page))


class SGLangPages(_InPlacePages):
    """kvtier's page view of an SGLang host pool: envelope slots here, payload in place.

    Page ``p`` is host tokens ``[p * page_size, (p + 1) * page_size)``. Its payload extents
    are the contiguous runs of SGLang's ``get_data_page(p * page_size, flat=False)`` view
    inside ``kv_buffer`` (the same bytes, in the same order, as SGLang's flat data page),
    checked to lie inside that buffer and cached, since the pool never moves. Ids from
    ``num_pages`` up are scratch pages: caller tensors of the legacy API.
    """

    def __init__(self, pool: Any, layout: Layout, geometry: KVGeometry) -> None:
        self.geometry = geometry
        self._layout = layout
        buffer = pool.kv_buffer
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
            raise unsupported_pool(pool, "its kv_buffer is not a CPU tensor")
        super().__init__(pool)
        storage = buffer.untyped_storage()
        self._low = storage.data_ptr()
        self._high = self._low + storage.nbytes()

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def page_bytes(self) -> int:
        """Bytes of one whole host page (SGLang's flat data page)."""
        return self.geometry.bytes_per_page

    #: What the pages are of, in errors: "" (whole pages) or a head slice.
    slice_note = ""

    def page_view(self, page: int) -> torch.Tensor:
        """The strided view of what this view stores of host page ``page``."""
        view: torch.Tensor = self.host_pool.get_data_page(page * self.page_size, flat=False)
        return view

    def memory_regions(self) -> list[Extent]:
        """SGLang's whole ``kv_buffer`` and the envelope slab: registered once by backends
        that need registered memory (Mooncake), so every page moves zero-copy."""
        return [
            _extent_at(self._low, self._high - self._low),
            self._header_slab(),
            self.spare_region(),
        ]

    def _page_runs(self, page: int) -> list[tuple[int, int]]:
        """The contiguous runs of the page's view inside SGLang's kv_buffer."""
        runs = _runs(self.page_view(page))
        total = sum(length for _, length in runs)
        outside = [a for a, n in runs if a < self._low or a + n > self._high]
        if outside or total != self.geometry.bytes_per_page:
            raise TransferError(
                f"SGLang host page {page}{self.slice_note} is {total} bytes in {len(runs)} "
                f"runs{' partly outside kv_buffer' if outside else ''}; the pool's geometry "
                f"({self.geometry.describe()}) says {self.geometry.bytes_per_page}: "
                "this host pool is not one kvtier understands",
                value=page,
            )
        return runs


class HeadSlicePages(SGLangPages):
    """Head slice ``index`` of ``slices`` of every page of an SGLang ``page_head`` host pool.

    Under SGLang's heterogeneous tensor parallelism (``tp_lcm_size``: instances of different
    ``--tp-size`` share one store), a rank of ``tp_size`` ranks stores each page as the
    ``tp_lcm_size // tp_size`` pages the ranks of a ``tp_lcm_size``-way instance hold: slice
    ``index`` is heads ``[index * h, (index + 1) * h)`` of the page (``h``: the pool's heads
    over ``slices``), its K run then its V run, the regions SGLang's
    ``get_split_heads_page_buffer_meta`` names. ``geometry`` is the slice's (``h`` heads): a
    slice is byte for byte the ``page_head`` page of that rank.
    """

    def __init__(
        self, pool: Any, layout: Layout, geometry: KVGeometry, index: int, slices: int
    ) -> None:
        self.index, self.slices = index, slices
        self.slice_note = f" (head slice {index} of {slices})"
        super().__init__(pool, layout, geometry)

    @property
    def page_bytes(self) -> int:
        return self.geometry.bytes_per_page * self.slices

    def _heads(self, view: torch.Tensor) -> torch.Tensor:
        # page_head: [kv, page, head, token-in-page, layer, dim]
        per = view.shape[2] // self.slices
        return view[:, :, self.index * per : (self.index + 1) * per]

    def page_view(self, page: int) -> torch.Tensor:
        return self._heads(super().page_view(page))

    def scratch_runs(self, tensor: torch.Tensor) -> list[tuple[int, int]]:
        pool = self.host_pool
        shape = (2, 1, int(pool.head_num), self.page_size, int(pool.layer_num), -1)
        return _runs(self._heads(tensor.view(shape)))


class SlotPages(_InPlacePages):
    """A state pool's pages in place: the regions its ``get_page_buffer_meta`` names.

    SGLang's ``MambaPoolHost`` (``page_first`` layouts, no side states) names each slot's
    temporal and conv states as ``(address, bytes)`` runs inside the buffers that
    ``get_hybrid_pool_buffer()`` lists, in the order of its flat data page. kvtier checks
    each run lies inside those buffers and serves them as the page's extents, so backends
    read and write state in place, and Mooncake registers the buffers once.
    """

    kind = "state"

    def __init__(self, pool: Any, page_bytes: int) -> None:
        super().__init__(pool)
        self._page_bytes = page_bytes
        self._buffers = [
            (t.data_ptr(), t.numel() * t.element_size())
            for t in pool.get_hybrid_pool_buffer()
            if isinstance(t, torch.Tensor) and t.numel() and t.device.type == "cpu"
        ]

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def layout(self) -> Layout:
        """A state page is a list of runs in flat-data-page order: filed as ``page_first``."""
        return Layout.PAGE_FIRST

    def memory_regions(self) -> list[Extent]:
        """The pool's state buffers and the envelope slab, for backends that register."""
        return [
            *(_extent_at(a, n) for a, n in self._buffers),
            self._header_slab(),
            self.spare_region(),
        ]

    def _page_runs(self, page: int) -> list[tuple[int, int]]:
        """The runs ``get_page_buffer_meta`` names for the page's slots, inside the
        pool's buffers."""
        first = page * self.page_size
        ptrs, sizes = self.host_pool.get_page_buffer_meta(
            torch.arange(first, first + self.page_size, dtype=torch.int64)
        )
        runs = [(int(a), int(n)) for a, n in zip(ptrs, sizes, strict=True)]
        inside = all(
            any(lo <= a and a + n <= lo + size for lo, size in self._buffers) for a, n in runs
        )
        total = sum(n for _, n in runs)
        if not inside or total != self.page_bytes:
            raise TransferError(
                f"SGLang state page {page} is {total} bytes in {len(runs)} runs"
                f"{'' if inside else ' partly outside the pool buffers'}; its flat data "
                f"page is {self.page_bytes} bytes: this state pool is not one kvtier "
                "can serve in place",
                value=page,
            )
        return runs


def in_place_refusal(pool: Any, page_bytes: int) -> str | None:
    """Why a state pool cannot be served in place (:class:`SlotPages`), or None if it can."""
    for method in ("get_page_buffer_meta", "get_hybrid_pool_buffer"):
        if not callable(getattr(pool, method, None)):
            return f"it has no {method}()"
    try:
        SlotPages(pool, page_bytes).extents(0)
    except (NotImplementedError, ValueError, AssertionError, TransferError) as exc:
        return f"its get_page_buffer_meta() refuses: {exc}"
    return None


class StatePages:
    """Flat state pages (a Mamba pool's) in kvtier's page form, one scratch page per call.

    SGLang's state pools gather a page into a fresh tensor (``get_data_page``) and scatter
    it back (``set_from_flat_data_page``), so there is no fixed memory to serve in place:
    each transfer registers the flat tensors it moves as pages, with an envelope slot
    each, and drops them when it returns.
    """

    def __init__(self, pool: Any, page_bytes: int) -> None:
        self.host_pool = pool
        self.page_bytes = page_bytes
        self.page_size = int(pool.page_size)
        self._pages = _Registered(0)

    @property
    def layout(self) -> Layout:
        """A state page is one contiguous run: kvtier files it as ``page_first``."""
        return Layout.PAGE_FIRST

    def _page(self, page: int) -> tuple[Extent, ...]:
        found = self._pages.get(page)
        if found is None:
            raise PageError(f"state page {page} is not part of a transfer in flight", value=page)
        return found

    def header_extent(self, page: int) -> Extent:
        return self._page(page)[0]

    def extents(self, page: int) -> list[Extent]:
        return list(self._page(page)[1:])

    def page_buffers(self, page: int) -> list[Extent]:
        return list(self._page(page))

    def add(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """Register contiguous flat tensors (``page_bytes`` each) as pages; returns ids.
        A tensor of another size, or a strided one, is refused before any is registered."""
        for tensor in tensors:
            length = tensor.numel() * tensor.element_size()
            if length != self.page_bytes or not tensor.is_contiguous():
                raise TransferError(
                    f"SGLang's {type(self.host_pool).__name__} gave a state page of "
                    f"{length} bytes{'' if tensor.is_contiguous() else ' (strided)'}; "
                    f"it registered pages of {self.page_bytes} contiguous bytes",
                    value=length,
                )
        return self._pages.add(tensors)

    def drop(self, ids: Sequence[int]) -> None:
        """Forget the pages of a transfer that returned."""
        self._pages.drop(ids)

    def held(self) -> int:
        """Pages registered now (in a transfer, or held for a late call)."""
        return len(self._pages)
