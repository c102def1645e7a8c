"""IO backends: every declared capability moves bytes bit-exactly; nothing else is accepted.

The matrix tests iterate each spec's *declared* capabilities, so a declaration that
promises something the backend cannot do fails here. Expected host contents are derived
from the axis orders documented in ``kvtier.core.layout``, independently of ``io.py``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.core.device_pool import (
    DevicePool,
    MHADevicePool,
    MLADevicePool,
    TorchDevicePool,
    layer_buffers,
)
from kvtier.core.errors import ConfigError, PageError, TransferError, UnsupportedCombinationError
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.io import (
    DIRECT_SPEC,
    KERNEL_SPEC,
    DirectIOBackend,
    IOBackend,
    KernelIOBackend,
    TransferPlan,
    capability_table,
    full_matrix,
)
from kvtier.core.layout import Layout, layouts_for
from kvtier.core.specs import (
    ALL_ATTENTION,
    ALL_LAYOUTS,
    ALL_OPERATIONS,
    BackendSpec,
    Capability,
    EmptyConfig,
    IOBackendSpec,
    Operation,
)

SPECS = [DIRECT_SPEC, KERNEL_SPEC]
DTYPES = ["float16", "bfloat16", "float32", "float8_e4m3fn"]
DEVICES = [
    "cpu",
    "cpu-staged",  # the CUDA path's batched crossings (TransferPlan.staged), run on CPU
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]
NUM_PAGES = 6  # host pages
NUM_SLOTS = 40  # device token slots: 10 device pages of 4
BATCH = 3  # pages per transfer
ALL_CAPS = [
    Capability(layout, attention, op)
    for layout, attention, op in itertools.product(Layout, AttentionKind, Operation)
]
BACKUPS = (Operation.BACKUP_ALL, Operation.BACKUP_LAYER)


def on(io: IOBackend, device: str) -> str:
    """The torch device for a ``DEVICES`` entry; ``cpu-staged`` makes ``io`` stage its copies."""
    if device == "cpu-staged":
        io.stage_always = True
        return "cpu"
    return device


def make_geometry(attention: AttentionKind, dtype: str = "bfloat16") -> KVGeometry:
    if attention is AttentionKind.MHA:
        return KVGeometry.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=4)
    return KVGeometry.mla(
        num_layers=3, kv_lora_rank=8, qk_rope_head_dim=4, dtype=dtype, page_size=4
    )


def build(spec: IOBackendSpec, geometry: KVGeometry, layout: Layout | str) -> IOBackend:
    io = spec.load_factory()(spec.config_model(), geometry, layout)
    assert isinstance(io, IOBackend)
    return io


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def host_tokens(host: HostPool, kv: int, pages: list[int]) -> torch.Tensor:
    """Raw bytes of ``pages`` as ``[page, token, layer, head, byte]``, from the doc's axes."""
    g, n, ps = host.geometry, host.num_pages, host.geometry.page_size
    buf = host.buffer if g.attention is AttentionKind.MHA else host.buffer.unsqueeze(0)
    b = raw(buf[kv])
    L, H = g.num_layers, g.num_kv_heads
    if host.layout is Layout.LAYER_FIRST:  # [layer, token, head, dim]
        v = b.view(L, n, ps, H, -1).permute(1, 2, 0, 3, 4)
    elif host.layout is Layout.PAGE_FIRST:  # [token, layer, head, dim]
        v = b.view(n, ps, L, H, -1)
    elif host.layout is Layout.PAGE_FIRST_DIRECT:  # [page, layer, token, head, dim]
        v = b.permute(0, 2, 1, 3, 4)
    else:  # page_head: [page, head, token, layer, dim]
        v = b.permute(0, 2, 3, 1, 4)
    return v[torch.tensor(pages, dtype=torch.long)]


def device_tokens(device: DevicePool, kv: int, slots: torch.Tensor) -> torch.Tensor:
    """Raw bytes at ``slots`` as ``[page, token, layer, head, byte]``, on the CPU."""
    g = device.geometry
    stacked = torch.stack(
        [raw(layer_buffers(device, layer)[kv]).cpu() for layer in range(g.num_layers)]
    )
    picked = stacked[:, slots.cpu()]
    return picked.view(g.num_layers, -1, g.page_size, *picked.shape[2:]).permute(1, 2, 0, 3, 4)


def pick_pages(gen: torch.Generator, n: int = BATCH) -> list[int]:
    return torch.randperm(NUM_PAGES, generator=gen)[:n].tolist()


def pick_slots(spec: IOBackendSpec, gen: torch.Generator, ps: int, n: int = BATCH) -> torch.Tensor:
    """Whole device pages for ``direct``, scattered single tokens for ``kernel``."""
    if spec is DIRECT_SPEC:
        pages = torch.randperm(NUM_SLOTS // ps, generator=gen)[:n]
        return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)
    return torch.randperm(NUM_SLOTS, generator=gen)[: n * ps]


def randomize_host(host: HostPool, gen: torch.Generator) -> None:
    for tensor in host.kv_buffers:
        b = raw(tensor)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))


def zero_host(host: HostPool) -> None:
    for tensor in host.kv_buffers:
        raw(tensor).zero_()


def snapshot(host: HostPool, device: TorchDevicePool) -> list[torch.Tensor]:
    return [raw(t).clone() for t in host.kv_buffers] + [
        raw(t).cpu().clone() for t in device.kv_tensors
    ]


# --- the declared matrix --------------------------------------------------------------

DECLARED = [
    pytest.param(spec, cap, id=f"{spec.name}-{cap}")
    for spec in SPECS
    for cap in sorted(spec.capabilities)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("spec", "cap"), DECLARED)
def test_declared_capability_moves_exactly_the_right_bytes(
    spec: IOBackendSpec, cap: Capability, dtype: str, device: str
) -> None:
    g = make_geometry(cap.attention, dtype)
    io = build(spec, g, cap.layout)
    device = on(io, device)
    gen = torch.Generator().manual_seed(sorted(spec.capabilities).index(cap) * 31 + len(dtype))
    host = HostPool(g, cap.layout, num_pages=NUM_PAGES)
    dev = TorchDevicePool(g, NUM_SLOTS, device)
    pages, slots = pick_pages(gen), pick_slots(spec, gen, g.page_size)
    per_layer = cap.operation in (Operation.BACKUP_LAYER, Operation.LOAD_LAYER)
    layer = 1 if per_layer else None
    layers = [1] if per_layer else list(range(g.num_layers))
    others = [lay for lay in range(g.num_layers) if lay not in layers]
    if cap.operation in BACKUPS:
        dev.fill_random_(gen)
        zero_host(host)
        io.backup(dev, host, slots.to(device), pages, layer=layer)
        untouched = [p for p in range(NUM_PAGES) if p not in pages]
        for kv in range(g.kv_count):
            got, want = host_tokens(host, kv, pages), device_tokens(dev, kv, slots)
            assert torch.equal(got[:, :, layers], want[:, :, layers])
            assert not got[:, :, others].any()
            assert not host_tokens(host, kv, untouched).any()
    else:
        randomize_host(host, gen)
        io.load(host, dev, pages, slots.to(device), layer=layer)
        rest = torch.tensor([s for s in range(NUM_SLOTS) if s not in set(slots.tolist())])
        for kv in range(g.kv_count):
            got, want = device_tokens(dev, kv, slots), host_tokens(host, kv, pages)
            assert torch.equal(got[:, :, layers], want[:, :, layers])
            assert not got[:, :, others].any()
            assert not raw(dev.kv_tensors[kv]).cpu()[:, rest].any()


ROUND_TRIPS = [
    pytest.param(spec, layout, attention, id=f"{spec.name}-{layout.value}-{attention.value}")
    for spec in SPECS
    for attention in AttentionKind
    for layout in layouts_for(attention)
    if spec.supports(layout, attention, Operation.BACKUP_ALL)
    and spec.supports(layout, attention, Operation.LOAD_ALL)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("spec", "layout", "attention"), ROUND_TRIPS)
def test_backup_then_load_into_other_slots_is_bit_exact(
    spec: IOBackendSpec, layout: Layout, attention: AttentionKind, dtype: str, device: str
) -> None:
    g = make_geometry(attention, dtype)
    io = build(spec, g, layout)
    device = on(io, device)
    gen = torch.Generator().manual_seed(7)
    source = TorchDevicePool(g, NUM_SLOTS, device).fill_random_(gen)
    target = TorchDevicePool(g, NUM_SLOTS, device)
    host = HostPool(g, layout, num_pages=NUM_PAGES)
    pages = pick_pages(gen)
    src, dst = pick_slots(spec, gen, g.page_size), pick_slots(spec, gen, g.page_size)
    io.backup(source, host, src.to(device), pages)
    io.load(host, target, pages, dst.to(device))
    for a, b in zip(source.kv_tensors, target.kv_tensors, strict=True):
        assert torch.equal(raw(a)[:, src.to(device)], raw(b)[:, dst.to(device)])
    if spec.supports(layout, attention, Operation.BACKUP_LAYER) and spec.supports(
        layout, attention, Operation.LOAD_LAYER
    ):
        host2 = HostPool(g, layout, num_pages=NUM_PAGES)
        target2 = TorchDevicePool(g, NUM_SLOTS, device)
        for layer in range(g.num_layers):
            io.backup(source, host2, src.to(device), pages, layer=layer)
        for layer in reversed(range(g.num_layers)):
            io.load(host2, target2, pages, dst.to(device), layer=layer)
        for page in pages:  # per-layer backups fill the same bytes as one all-layer backup
            for e1, e2 in zip(host.extents(page), host2.extents(page), strict=True):
                assert bytes(e1.view) == bytes(e2.view)
        for a, b in zip(target.kv_tensors, target2.kv_tensors, strict=True):
            assert torch.equal(raw(a), raw(b))


class ListDevicePool:
    """An engine-style pool: one separate tensor per layer (nothing to stack)."""

    def __init__(self, geometry: KVGeometry, num_slots: int, gen: torch.Generator) -> None:
        self.geometry, self.num_slots, self.device = geometry, num_slots, torch.device("cpu")
        shape = (num_slots, geometry.num_kv_heads, geometry.head_dim)
        self.layers = [
            [
                torch.randint(
                    0,
                    256,
                    (*shape[:-1], shape[-1] * geometry.itemsize),
                    dtype=torch.uint8,
                    generator=gen,
                ).view(geometry.dtype)
                for _ in range(geometry.kv_count)
            ]
            for _ in range(geometry.num_layers)
        ]

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.layers[layer][0]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.layers[layer][1]

    def latent_buffer(self, layer: int) -> torch.Tensor:
        return self.layers[layer][0]


@pytest.mark.parametrize("staged", [False, True], ids=["direct-copies", "staged"])
@pytest.mark.parametrize(("spec", "layout", "attention"), ROUND_TRIPS)
def test_per_layer_tensors_that_do_not_stack_round_trip_too(
    spec: IOBackendSpec, layout: Layout, attention: AttentionKind, staged: bool
) -> None:
    g = make_geometry(attention, "bfloat16")
    io = build(spec, g, layout)
    io.stage_always = staged
    gen = torch.Generator().manual_seed(3)
    source, target = ListDevicePool(g, NUM_SLOTS, gen), ListDevicePool(g, NUM_SLOTS, gen)
    host = HostPool(g, layout, num_pages=NUM_PAGES)
    pages = pick_pages(gen)
    src, dst = pick_slots(spec, gen, g.page_size), pick_slots(spec, gen, g.page_size)
    io.backup(source, host, src, pages)
    io.load(host, target, pages, dst)
    for kv in range(g.kv_count):
        assert torch.equal(device_tokens(source, kv, src), device_tokens(target, kv, dst))


def test_the_declared_matrix_is_complete_for_both_attention_kinds() -> None:
    for spec in SPECS:
        assert spec.capabilities == full_matrix()
        assert spec.devices == {"cpu", "cuda"}
    assert len(full_matrix()) == (4 + 3) * 4


UNDECLARED = [
    pytest.param(spec, cap, id=f"{spec.name}-{cap}")
    for spec in SPECS
    for cap in ALL_CAPS
    if cap not in spec.capabilities
]


def _reference_backend() -> BackendSpec:
    return BackendSpec(
        name="ref",
        factory=lambda *a: None,
        layouts=ALL_LAYOUTS,
        attention=ALL_ATTENTION,
        operations=ALL_OPERATIONS,
    )


@pytest.mark.parametrize(("spec", "cap"), UNDECLARED)
def test_undeclared_combinations_are_refused_at_config_time(
    spec: IOBackendSpec, cap: Capability
) -> None:
    assert not spec.supports(*cap)
    g = make_geometry(cap.attention)
    with pytest.raises(ConfigError):
        build(spec, g, cap.layout)
    capabilities = pytest.importorskip("kvtier.core.capabilities")
    config_module = pytest.importorskip("kvtier.core.config")
    geometry_fields: dict[str, Any] = (
        {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8}
        if cap.attention is AttentionKind.MHA
        else {"num_layers": 3, "kv_lora_rank": 8, "qk_rope_head_dim": 4}
    )
    config = config_module.EngineConfig(
        backend="ref",
        io_backend=spec.name,
        layout=cap.layout.value,
        attention=cap.attention,
        operations=(cap.operation,),
        page_size=4,
        host_pages=NUM_PAGES,
        **geometry_fields,
    )
    with pytest.raises(UnsupportedCombinationError) as info:
        capabilities.resolve(config, {"ref": _reference_backend()}, {s.name: s for s in SPECS})
    working = f"io_backend={spec.name} layout={Layout.PAGE_FIRST_DIRECT.value}"
    assert working in info.value.supported
    assert all(Layout.PAGE_HEAD.value not in line for line in info.value.supported)


def test_an_operation_a_backend_does_not_declare_is_refused_before_anything_moves() -> None:
    g = make_geometry(AttentionKind.MHA)
    partial = frozenset(c for c in full_matrix() if c.operation is not Operation.LOAD_LAYER)
    io = KernelIOBackend(g, "page_first", partial)
    assert not io.supports(Operation.LOAD_LAYER) and io.supports(Operation.LOAD_ALL)
    host = HostPool(g, "page_first", num_pages=NUM_PAGES)
    randomize_host(host, torch.Generator().manual_seed(1))
    dev = TorchDevicePool(g, NUM_SLOTS)
    with pytest.raises(TransferError, match="does not execute load_layer") as info:
        io.load(host, dev, [0], torch.arange(4), layer=0)
    assert info.value.value is Operation.LOAD_LAYER
    assert not raw(dev.kv_tensors[0]).any()
    with pytest.raises(UnsupportedCombinationError, match="page_head"):
        DirectIOBackend(
            g, "page_head", partial - {c for c in partial if c.layout is Layout.PAGE_HEAD}
        )


class RecordingIO(IOBackend):
    """A third-party style IO backend: only sees validated plans."""

    name = "recording"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.plans: list[tuple[str, TransferPlan]] = []

    def run_backup(self, plan: TransferPlan) -> None:
        self.plans.append(("backup", plan))

    def run_load(self, plan: TransferPlan) -> None:
        self.plans.append(("load", plan))


def test_subclasses_receive_only_validated_non_empty_plans() -> None:
    g = make_geometry(AttentionKind.MLA)
    io = RecordingIO(g, "page_first", full_matrix())
    host = HostPool(g, "page_first", num_pages=NUM_PAGES)
    dev = TorchDevicePool(g, NUM_SLOTS)
    io.backup(dev, host, torch.empty(0, dtype=torch.int64), [])
    with pytest.raises(TransferError):
        io.load(host, dev, [NUM_PAGES], torch.arange(4))
    assert io.plans == []
    io.load(host, dev, [5, 0], torch.arange(8, 16, dtype=torch.int32), layer=2)
    ((kind, plan),) = io.plans
    assert kind == "load" and plan.pages == [5, 0] and plan.layer == 2
    assert plan.slots.dtype == torch.int64 and plan.slots.tolist() == list(range(8, 16))


# --- edge cases -----------------------------------------------------------------------


@pytest.fixture(params=SPECS, ids=lambda s: s.name)
def spec(request: pytest.FixtureRequest) -> IOBackendSpec:
    return request.param  # type: ignore[no-any-return]


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_empty_batches_are_no_ops(spec: IOBackendSpec, layout: str) -> None:
    g = make_geometry(AttentionKind.MHA, "float8_e4m3fn")
    io = build(spec, g, layout)
    gen = torch.Generator().manual_seed(5)
    host = HostPool(g, layout, num_pages=NUM_PAGES)
    randomize_host(host, gen)
    dev = TorchDevicePool(g, NUM_SLOTS).fill_random_(gen)
    before = snapshot(host, dev)
    empty = torch.empty(0, dtype=torch.int64)
    for layer in (None, 2):
        io.backup(dev, host, empty, [], layer=layer)
        io.load(host, dev, [], empty, layer=layer)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(host, dev), strict=True))


@pytest.mark.parametrize("attention", list(AttentionKind))
def test_single_last_page_of_both_pools(spec: IOBackendSpec, attention: AttentionKind) -> None:
    g = make_geometry(attention, "float32")
    gen = torch.Generator().manual_seed(11)
    for layout in layouts_for(attention):
        io = build(spec, g, layout)
        host = HostPool(g, layout, num_pages=NUM_PAGES)
        source = TorchDevicePool(g, NUM_SLOTS).fill_random_(gen)
        target = TorchDevicePool(g, NUM_SLOTS)
        last_slots = torch.arange(NUM_SLOTS - g.page_size, NUM_SLOTS)
        io.backup(source, host, last_slots, [NUM_PAGES - 1])
        io.load(host, target, [NUM_PAGES - 1], last_slots)
        for a, b in zip(source.kv_tensors, target.kv_tensors, strict=True):
            assert torch.equal(raw(a)[:, -g.page_size :], raw(b)[:, -g.page_size :])
            assert not raw(b)[:, : -g.page_size].any()


def _bad_calls(
    io: IOBackend, g: KVGeometry
) -> list[tuple[str, Any, Any, dict[str, Any], str, Any]]:
    """(op, slots, pages, kwargs, message, offending value) that must all be refused."""
    ps = g.page_size
    page0 = torch.arange(ps)
    return [
        ("both", page0, [NUM_PAGES], {}, "host page 6 is out of range", NUM_PAGES),
        ("both", page0, [-1], {}, "host page -1 is out of range", -1),
        (
            "both",
            torch.arange(NUM_SLOTS - ps + 1, NUM_SLOTS + 1),
            [0],
            {},
            "device slot 40",
            NUM_SLOTS,
        ),
        ("both", page0 - 1, [0], {}, "device slot -1", -1),
        ("both", page0, [0, 1], {}, "expected 8", ps),
        ("both", torch.arange(2 * ps), [0], {}, "expected 4", 2 * ps),
        ("both", page0, [0], {"layer": g.num_layers}, "layer 3 is out of range", 3),
        ("both", page0, [0], {"layer": -1}, "layer -1 is out of range", -1),
        ("both", page0.float(), [0], {}, "must hold integers", torch.float32),
        ("both", page0.view(2, 2), [0], {}, "must be 1-D", (2, 2)),
        ("both", page0.tolist(), [0], {}, "must be an int64 torch.Tensor", page0.tolist()),
        ("both", page0, [True], {}, "is not an int", True),
        ("backup", torch.arange(2 * ps), [2, 2], {}, "host page 2 appears twice", 2),
        ("load", torch.cat([page0, page0]), [1, 2], {}, "device slot 0 appears twice", 0),
    ]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_bad_requests_raise_transfer_errors_and_write_nothing(
    spec: IOBackendSpec, layout: str
) -> None:
    g = make_geometry(AttentionKind.MHA, "bfloat16")
    io = build(spec, g, layout)
    gen = torch.Generator().manual_seed(13)
    host = HostPool(g, layout, num_pages=NUM_PAGES)
    randomize_host(host, gen)
    dev = TorchDevicePool(g, NUM_SLOTS).fill_random_(gen)
    before = snapshot(host, dev)
    for op, slots, pages, kwargs, message, value in _bad_calls(io, g):
        calls = []
        if op in ("both", "backup"):
            calls.append(lambda s=slots, p=pages, k=kwargs: io.backup(dev, host, s, p, **k))
        if op in ("both", "load"):
            calls.append(lambda s=slots, p=pages, k=kwargs: io.load(host, dev, p, s, **k))
        for call in calls:
            with pytest.raises(TransferError, match=message) as info:
                call()
            if isinstance(value, (int, tuple, list, torch.dtype)):
                assert info.value.value == value, message
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(host, dev), strict=True))


def test_checked_calls_skip_only_the_slot_and_layer_checks(spec: IOBackendSpec) -> None:
    """``checked=True`` (TieredCache checked slots and layer) still refuses bad page ids."""
    g = make_geometry(AttentionKind.MHA)
    io = build(spec, g, "page_first")
    host = HostPool(g, "page_first", num_pages=NUM_PAGES)
    dev = TorchDevicePool(g, NUM_SLOTS)
    slots = torch.arange(g.page_size)
    io.backup(dev, host, slots, [1], layer=2, checked=True)
    io.load(host, dev, [1], slots, checked=True)
    for pages, message in (([NUM_PAGES], "host page 6 is out of range"), ([True], "not an int")):
        with pytest.raises(TransferError, match=message):
            io.backup(dev, host, slots, pages, checked=True)
    with pytest.raises(TransferError, match="host page 2 appears twice"):
        io.backup(dev, host, torch.arange(2 * g.page_size), [2, 2], checked=True)


def test_host_page_ids_get_one_message_from_the_pool_and_the_io_backend(
    spec: IOBackendSpec,
) -> None:
    g = make_geometry(AttentionKind.MHA)
    io = build(spec, g, "page_first")
    host = HostPool(g, "page_first", num_pages=NUM_PAGES)
    dev = TorchDevicePool(g, NUM_SLOTS)
    for bad in (NUM_PAGES, -1, True, "1"):
        with pytest.raises(TransferError) as from_io:
            io.backup(dev, host, torch.arange(g.page_size), [bad])
        with pytest.raises(PageError) as from_pool:
            host.extents(bad)  # type: ignore[arg-type]
        assert str(from_io.value) == str(from_pool.value)
        assert from_io.value.value == bad and f"pages 0..{NUM_PAGES - 1}" in str(from_io.value)


def test_mismatched_pools_are_refused(spec: IOBackendSpec) -> None:
    g = make_geometry(AttentionKind.MHA)
    other = make_geometry(AttentionKind.MHA, "float16")
    io = build(spec, g, "page_first")
    slots = torch.arange(4)
    with pytest.raises(TransferError, match="host pool layout 'layer_first'"):
        io.backup(
            TorchDevicePool(g, NUM_SLOTS), HostPool(g, "layer_first", num_pages=2), slots, [0]
        )
    with pytest.raises(TransferError, match="device pool geometry"):
        io.backup(
            TorchDevicePool(other, NUM_SLOTS), HostPool(g, "page_first", num_pages=2), slots, [0]
        )
    with pytest.raises(TransferError, match="must be a kvtier HostPool"):
        io.backup(TorchDevicePool(g, NUM_SLOTS), object(), slots, [0])  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="host pool geometry"):
        io.load(
            HostPool(other, "page_first", num_pages=2), TorchDevicePool(g, NUM_SLOTS), [0], slots
        )


def test_direct_refuses_token_granular_slots_and_names_kernel() -> None:
    g = make_geometry(AttentionKind.MHA)
    io = build(DIRECT_SPEC, g, "page_first_direct")
    host = HostPool(g, "page_first_direct", num_pages=NUM_PAGES)
    dev = TorchDevicePool(g, NUM_SLOTS).fill_random_(torch.Generator().manual_seed(2))
    zero_host(host)
    for slots in (
        torch.arange(1, 5),
        torch.tensor([4, 5, 7, 6]),
        torch.tensor([0, 1, 2, 3, 9, 8, 10, 11]),
    ):
        pages = list(range(len(slots) // 4))
        with pytest.raises(TransferError, match="Use the 'kernel' IO backend") as info:
            io.backup(dev, host, slots, pages)
        assert isinstance(info.value.value, list)
    assert not any(raw(t).any() for t in host.kv_buffers)
    # the same slots are fine for kernel
    build(KERNEL_SPEC, g, "page_first_direct").backup(dev, host, torch.tensor([4, 5, 7, 6]), [0])


# --- device pools, plugin registration, docs -------------------------------------------


def test_torch_device_pool_follows_the_protocols() -> None:
    mha = TorchDevicePool(make_geometry(AttentionKind.MHA), 8)
    mla = TorchDevicePool(make_geometry(AttentionKind.MLA), 8)
    assert isinstance(mha, DevicePool) and isinstance(mha, MHADevicePool)
    assert isinstance(mla, MLADevicePool)
    assert mha.k_buffer(2).shape == (8, 2, 8) and mla.latent_buffer(0).shape == (8, 1, 12)
    with pytest.raises(TypeError, match="MLA pools"):
        mha.latent_buffer(0)
    with pytest.raises(TypeError, match="MHA pools"):
        mla.k_buffer(0)
    a = TorchDevicePool(mha.geometry, 8).fill_random_(torch.Generator().manual_seed(4))
    b = TorchDevicePool(mha.geometry, 8).fill_random_(torch.Generator().manual_seed(4))
    assert torch.equal(raw(a.kv_tensors[1]), raw(b.kv_tensors[1])) and raw(a.kv_tensors[1]).any()
    assert not raw(a.zero_().kv_tensors[1]).any()


def test_device_pools_with_wrong_buffers_are_refused() -> None:
    g = make_geometry(AttentionKind.MHA)

    class NoBuffers:
        geometry, num_slots, device = g, 8, torch.device("cpu")

    class WrongShape(NoBuffers):
        def k_buffer(self, layer: int) -> torch.Tensor:
            return torch.zeros(8, 2, 4, dtype=g.dtype)

        v_buffer = k_buffer

    class ClaimsMeta(WrongShape):
        device = torch.device("meta")

    io = build(KERNEL_SPEC, g, "page_first")
    host = HostPool(g, "page_first", num_pages=2)
    with pytest.raises(TransferError, match="its device is meta"):
        io.backup(ClaimsMeta(), host, torch.arange(4), [0])  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="lacks k_buffer"):
        io.backup(NoBuffers(), host, torch.arange(4), [0])  # type: ignore[arg-type]
    with pytest.raises(TransferError, match=r"expected \(8, 2, 8\)"):
        io.backup(WrongShape(), host, torch.arange(4), [0])  # type: ignore[arg-type]


def test_builtin_plugin_registers_both_specs() -> None:
    from kvtier.plugins import builtin_io
    from kvtier.plugins.manager import load_registry

    seen: list[IOBackendSpec] = []
    builtin_io.kvtier_register_io_backends(seen.append)
    assert seen == [DIRECT_SPEC, KERNEL_SPEC]
    registry = load_registry(autoload=False)
    assert registry.io_backend("direct") is DIRECT_SPEC
    assert registry.io_backend("kernel") is KERNEL_SPEC
    assert "builtin_io" in str(registry.origin("io_backend", "kernel"))


def test_factories_take_validated_config() -> None:
    io = DIRECT_SPEC.load_factory()(EmptyConfig(), make_geometry(AttentionKind.MLA), "layer_first")
    assert isinstance(io, DirectIOBackend) and io.layout is Layout.LAYER_FIRST


def test_docs_carry_the_generated_capability_table() -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "data-plane.md"
    assert capability_table(SPECS) in doc.read_text(encoding="utf-8")


# --- runs of consecutive pages: one strided copy (kernel) or one gather (direct) --------


class InterleavedDevicePool:
    """K and V of a slot side by side in one ``[layers, slots, kv, heads, dim]`` tensor:
    every buffer strided, the layers still views of one storage (they stack)."""

    def __init__(self, geometry: KVGeometry, num_slots: int, gen: torch.Generator) -> None:
        self.geometry, self.num_slots, self.device = geometry, num_slots, torch.device("cpu")
        g = geometry
        shape = (g.num_layers, num_slots, g.kv_count, g.num_kv_heads, g.head_dim * g.itemsize)
        self.memory = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        self.kv = [self.memory[:, :, kv].view(g.dtype) for kv in range(g.kv_count)]

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.kv[0][layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.kv[1][layer]

    def latent_buffer(self, layer: int) -> torch.Tensor:
        return self.kv[0][layer]


def _pool(kind: str, g: KVGeometry, gen: torch.Generator) -> Any:
    if kind == "stacked":
        return TorchDevicePool(g, NUM_SLOTS).fill_random_(gen)
    if kind == "interleaved":
        return InterleavedDevicePool(g, NUM_SLOTS, gen)
    return ListDevicePool(g, NUM_SLOTS, gen)  # one tensor per layer: nothing to stack


#: (host pages, device slots) in runs: a whole aligned run, a run starting mid-page (the
#: kernel's slots need not be page-aligned), two runs with a gap between them.
RUNS = {
    "aligned": ([1, 2, 3], list(range(8, 20))),
    "mid-page": ([2, 3], list(range(5, 13))),
    "two-runs": ([0, 1, 4, 5], [*range(3, 11), *range(24, 32)]),
}


@pytest.mark.parametrize("runs", list(RUNS))
@pytest.mark.parametrize("pool", ["stacked", "interleaved", "per-layer"])
@pytest.mark.parametrize(
    ("layout", "attention"),
    [(lay, att) for att in AttentionKind for lay in layouts_for(att)],
    ids=lambda v: v.value,
)
def test_kernel_runs_of_consecutive_slots_round_trip_bit_exactly(
    layout: Layout, attention: AttentionKind, pool: str, runs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the path kvtier bench and most engine loads take: consecutive host pages whose
    # slots are one ascending range move as one strided copy per kv (and layer view)
    from kvtier.core import io as io_module

    starts: list[int | None] = []
    real = io_module._slot_range
    monkeypatch.setattr(
        io_module, "_slot_range", lambda rows: starts.append(real(rows)) or real(rows)
    )
    g = make_geometry(attention, "bfloat16")
    io = build(KERNEL_SPEC, g, layout)
    gen = torch.Generator().manual_seed(5)
    pages, slot_list = RUNS[runs]
    slots = torch.tensor(slot_list)
    other = torch.tensor([s + 1 if runs == "aligned" else s + 4 for s in slot_list])  # elsewhere
    source, target = _pool(pool, g, gen), _pool(pool, g, gen)
    before = [
        raw(t).clone()
        for t in (
            layer_buffers(target, lay)[kv]
            for lay in range(g.num_layers)
            for kv in range(g.kv_count)
        )
    ]
    host = HostPool(g, layout, num_pages=NUM_PAGES)
    zero_host(host)
    io.backup(source, host, slots, pages)
    for kv in range(g.kv_count):  # the host holds the slots' bytes, in the layout's order
        assert torch.equal(host_tokens(host, kv, pages), device_tokens(source, kv, slots))
    io.load(host, target, pages, other)
    for kv in range(g.kv_count):
        assert torch.equal(device_tokens(target, kv, other), device_tokens(source, kv, slots))
    untouched = torch.tensor([s for s in range(NUM_SLOTS) if s not in set(other.tolist())])
    for i, (lay, kv) in enumerate(
        (lay, kv) for lay in range(g.num_layers) for kv in range(g.kv_count)
    ):
        now = raw(layer_buffers(target, lay)[kv])
        assert torch.equal(now[untouched], before[i][untouched])  # nothing else written
    # per layer, in reverse, into a fresh host pool: the same bytes
    host2 = HostPool(g, layout, num_pages=NUM_PAGES)
    for layer in reversed(range(g.num_layers)):
        io.backup(source, host2, slots, pages, layer=layer)
    for page in pages:
        for e1, e2 in zip(host.extents(page), host2.extents(page), strict=True):
            assert bytes(e1.view) == bytes(e2.view)
    assert starts and all(start is not None for start in starts)  # every run was a range


@pytest.mark.parametrize("device_pages", [[7, 2, 5, 0], [3, 4, 9, 8]], ids=["shuffled", "two-runs"])
@pytest.mark.parametrize(
    ("layout", "attention"),
    [(lay, att) for att in AttentionKind for lay in layouts_for(att)],
    ids=lambda v: v.value,
)
def test_direct_gathers_scattered_device_pages_bit_exactly(
    layout: Layout,
    attention: AttentionKind,
    device_pages: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # consecutive host pages from device pages in block-table order: on a CPU pool one
    # gather / index_copy_ per kv (but for page_head, whose rows are one head's dim values)
    g = make_geometry(attention, "float16")
    ps = g.page_size
    io = build(DIRECT_SPEC, g, layout)
    gen = torch.Generator().manual_seed(9)
    source = TorchDevicePool(g, NUM_SLOTS).fill_random_(gen)
    target = TorchDevicePool(g, NUM_SLOTS)
    host = HostPool(g, layout, num_pages=NUM_PAGES)
    pages = [1, 2, 3, 4]
    slots = (torch.tensor(device_pages)[:, None] * ps + torch.arange(ps)).reshape(-1)
    scatters: list[int] = []
    real = torch.Tensor.index_copy_
    monkeypatch.setattr(
        torch.Tensor, "index_copy_", lambda self, *a: scatters.append(1) or real(self, *a)
    )
    for layer in (None, 1):
        scatters.clear()
        zero_host(host)
        for t in target.kv_tensors:
            raw(t).zero_()
        io.backup(source, host, slots, pages, layer=layer)
        io.load(host, target, pages, slots, layer=layer)
        layers = list(range(g.num_layers)) if layer is None else [layer]
        for kv in range(g.kv_count):
            want = device_tokens(source, kv, slots)[:, :, layers]
            assert torch.equal(host_tokens(host, kv, pages)[:, :, layers], want)
            assert torch.equal(device_tokens(target, kv, slots)[:, :, layers], want)
            rest = [s for s in range(NUM_SLOTS) if s not in set(slots.tolist())]
            assert not raw(target.kv_tensors[kv])[:, rest].any()
        # one op where the host keeps each slot's heads x dim row whole, as the device
        # does; page_head's rows are one head's dim values: a copy per page
        assert bool(scatters) is (layout is not Layout.PAGE_HEAD)


@pytest.mark.parametrize(("spec", "layout", "attention"), ROUND_TRIPS)
def test_staged_crossings_in_blocks_of_a_few_pages_round_trip_bit_exactly(
    spec: IOBackendSpec,
    layout: Layout,
    attention: AttentionKind,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large staged transfer crosses in blocks of at most STAGE_BYTES: here 1-2 pages."""
    import kvtier.core.io as io_module

    g = make_geometry(attention, "bfloat16")
    io = build(spec, g, layout)
    io.stage_always = True
    monkeypatch.setattr(io_module, "STAGE_BYTES", g.bytes_per_page // g.kv_count + 1)
    gen = torch.Generator().manual_seed(11)
    source = TorchDevicePool(g, NUM_SLOTS, "cpu").fill_random_(gen)
    target = TorchDevicePool(g, NUM_SLOTS, "cpu")
    host = HostPool(g, layout, num_pages=NUM_PAGES)
    pages = [4, 0, 1, 2, 5]  # runs of 1 and 3 pages, cut by the blocks
    src, dst = pick_slots(spec, gen, g.page_size, 5), pick_slots(spec, gen, g.page_size, 5)
    io.backup(source, host, src, pages)
    io.load(host, target, pages, dst)
    for a, b in zip(source.kv_tensors, target.kv_tensors, strict=True):
        assert torch.equal(raw(a)[:, src], raw(b)[:, dst])
    for layer in range(g.num_layers):  # one layer at a time crosses the same way
        io.load(host, target, pages, dst, layer=layer)
        io.backup(target, host, dst, pages, layer=layer)
    for a, b in zip(source.kv_tensors, target.kv_tensors, strict=True):
        assert torch.equal(raw(a)[:, src], raw(b)[:, dst])
