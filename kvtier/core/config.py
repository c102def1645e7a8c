"""The engine config: everything an engine tells kvtier at start-up, validated first.

:class:`EngineConfig` and :func:`load_engine_config` build it from JSON text, ``@file``
or a mapping, through the one parser (:mod:`kvtier.core.extra_config`) and the one
validation path (:mod:`kvtier.core.validation`), so every problem surfaces as an error of
the :mod:`kvtier.core.errors` hierarchy that names the culprit, its place and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvtier.core.errors import (
    ConfigError,
    InvalidFieldError,
    MissingFieldError,
    did_you_mean,
)
from kvtier.core.extra_config import parse_extra_config
from kvtier.core.geometry import AttentionKind, KVGeometry, dtype_from_name, dtype_name
from kvtier.core.layout import Layout
from kvtier.core.specs import Operation
from kvtier.core.tiers import TenantConfig, TierConfig
from kvtier.core.validation import raise_problems, validate_model

__all__ = [
    "AUTO",
    "DEFAULT_BACKEND",
    "GEOMETRY_DEFAULTS",
    "ChecksumWorkers",
    "EngineConfig",
    "ModelId",
    "TenantLimits",
    "TierChain",
    "load_engine_config",
]

#: The storage backend an engine gets when it names none.
DEFAULT_BACKEND = "file"
#: The value of ``io_backend`` / ``layout`` that lets capability resolution choose.
AUTO = "auto"

#: Geometry the CLI fills in when a check is run without one (never used by engines).
GEOMETRY_DEFAULTS: dict[AttentionKind, dict[str, int]] = {
    AttentionKind.MHA: {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    AttentionKind.MLA: {"num_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
}
_GEOMETRY_FIELDS: dict[AttentionKind, tuple[str, ...]] = {
    kind: tuple(fields) for kind, fields in GEOMETRY_DEFAULTS.items()
}


PositiveInt = Annotated[int, Field(strict=True, gt=0)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]

# Fields the engine config shares with each engine's ``kvtier`` section
# (:mod:`kvtier.integrations.section`), declared once here: the type, its checks and,
# where every model agrees, the default. A model names the field with one of these and
# adds the description its operators read (and its own default where models differ).

#: ``model``: the model id in the page-key namespace.
ModelId = Annotated[str, Field(min_length=1)]
#: ``tiers``: a chain of storage tiers, fastest first, instead of ``backend`` and
#: ``extra_config``; none by default.
TierChain = Annotated[tuple[TierConfig, ...], Field(default_factory=tuple)]
#: ``tenants``: per-tenant limits by tenant name; none by default.
TenantLimits = Annotated[dict[str, TenantConfig], Field(default_factory=dict)]
#: ``checksum_workers``: threads that checksum the pages of one batch.
ChecksumWorkers = Annotated[int, Field(strict=True, ge=1, le=64)]


def _attention_fields_check(config: EngineConfig) -> None:
    """Geometry fields of the other attention kind are an error, not silently ignored."""
    other = AttentionKind.MLA if config.attention is AttentionKind.MHA else AttentionKind.MHA
    mine = set(_GEOMETRY_FIELDS[config.attention])
    for name in _GEOMETRY_FIELDS[other]:
        if name not in mine and getattr(config, name) is not None:
            raise InvalidFieldError(
                name,
                f"is an {other.value.upper()} geometry field but attention is "
                f"{config.attention.value!r}; an {config.attention.value.upper()} geometry takes "
                f"{', '.join(_GEOMETRY_FIELDS[config.attention])}",
                value=getattr(config, name),
            )


class EngineConfig(BaseModel):
    """Everything an engine tells kvtier at start-up; validated before anything is built."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(
        DEFAULT_BACKEND, description="Storage backend name (`kvtier backends` lists them)."
    )
    io_backend: str = Field(
        AUTO,
        description="IO backend that moves pages device <-> host, "
        "or `auto` for the best one that supports the plan.",
    )
    layout: str = Field(
        AUTO,
        description="Host-pool layout (`layer_first`, `page_first`, "
        "`page_first_direct`, `page_head`), or `auto`.",
    )
    attention: AttentionKind = Field(
        AttentionKind.MHA,
        description="`mha` (separate K and V, GQA included) or `mla` (one latent vector).",
    )
    num_layers: PositiveInt | None = Field(None, description="Number of layers.")
    num_kv_heads: PositiveInt | None = Field(
        None, description="MHA: KV heads held by this rank (its share under tensor parallelism)."
    )
    head_dim: PositiveInt | None = Field(None, description="MHA: size of one head.")
    kv_lora_rank: PositiveInt | None = Field(None, description="MLA: latent rank.")
    qk_rope_head_dim: PositiveInt | None = Field(None, description="MLA: rope part of the latent.")
    dtype: str = Field(
        "bfloat16",
        description="KV dtype: float16, bfloat16, float32, float8_* "
        "(aliases bf16, fp16, fp8 accepted).",
    )
    page_size: PositiveInt = Field(64, description="Tokens per page.")
    tp_rank: NonNegativeInt = Field(0, description="This rank under tensor parallelism.")
    tp_size: PositiveInt = Field(
        1, description="Tensor-parallel world size; 0 <= tp_rank < tp_size."
    )
    operations: tuple[Operation, ...] = Field(
        (Operation.BACKUP_ALL, Operation.LOAD_ALL),
        min_length=1,
        description="Transfers the engine will use: backup_all, load_all, load_layer, "
        "backup_layer.",
    )
    model: ModelId = Field("default", description="Model id, part of the page-key namespace.")
    tenant: str | None = Field(
        None, description="Tenant salt for the key namespace, so tenants never share pages."
    )
    verify: Literal["full", "header"] = Field(
        "full",
        description="Page verification on load: "
        "`full` checksums the payload, `header` checks "
        "only the envelope header.",
    )
    host_pages: PositiveInt | None = Field(
        None, description="Host-pool size in pages (or give host_bytes)."
    )
    host_bytes: PositiveInt | None = Field(
        None, description="Host-pool size in bytes (or give host_pages)."
    )
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="The backend's own "
        "options: JSON object string, `@file.json`, "
        "`@file.toml` or a mapping.",
    )

    tiers: TierChain = Field(
        description="A chain of storage tiers, fastest first (see docs/tiers.md), instead "
        "of `backend` and `extra_config` (a chain of one).",
    )
    tenants: TenantLimits = Field(
        description="Per-tenant limits by tenant name: `quota_bytes` in each tier.",
    )

    @field_validator("extra_config", mode="before")
    @classmethod
    def _parse_extra(cls, value: Any) -> dict[str, Any]:
        return parse_extra_config(value, source="extra_config")

    def storage_tiers(self) -> tuple[TierConfig, ...]:
        """The chain of storage tiers: ``tiers``, or one tier of ``backend``/``extra_config``."""
        if self.tiers:
            return self.tiers
        return (TierConfig(backend=self.backend, extra_config=self.extra_config),)

    @field_validator("backend", "io_backend")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty name (`kvtier backends` lists them)")
        return value.strip()

    @field_validator("layout")
    @classmethod
    def _layout(cls, value: str) -> str:
        value = value.strip().lower()
        choices = [AUTO, *(layout.value for layout in Layout)]
        if value not in choices:
            raise ValueError(
                f"unknown layout {value!r}{did_you_mean(value, choices)}; "
                f"choose one of {', '.join(choices)}"
            )
        return value

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        try:
            return dtype_name(dtype_from_name(value.strip()))
        except InvalidFieldError as exc:
            raise ValueError(str(exc).removeprefix("dtype: ")) from None

    @model_validator(mode="after")
    def _cross_checks(self) -> EngineConfig:
        if self.tp_rank >= self.tp_size:
            raise InvalidFieldError(
                "tp_rank",
                f"must be below tp_size ({self.tp_size}), got {self.tp_rank}",
                value=self.tp_rank,
            )
        if self.host_pages is not None and self.host_bytes is not None:
            raise InvalidFieldError(
                "host_bytes", "give host_pages or host_bytes, not both", value=self.host_bytes
            )
        _attention_fields_check(self)
        if self.tiers:
            both = sorted({"backend", "extra_config"} & self.model_fields_set)
            if both:
                raise InvalidFieldError(
                    both[0],
                    "give either `backend` (with its `extra_config`) or `tiers`, not both: "
                    "with `tiers`, each tier names its backend and options",
                    value=getattr(self, both[0]),
                )
        return self

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Validate a mapping, raising kvtier config errors."""
        return validate_model(cls, data, where="", label="engine config")

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        """Parse a JSON object string or ``@file.json`` / ``@file.toml`` and validate it."""
        return load_engine_config(text)

    def missing_geometry(self) -> list[str]:
        """The geometry fields this attention kind needs that are not set."""
        return [name for name in _GEOMETRY_FIELDS[self.attention] if getattr(self, name) is None]

    def geometry(self) -> KVGeometry:
        """The KV geometry; a missing field raises MissingFieldError naming all missing ones."""
        missing = self.missing_geometry()
        if missing:
            needed = ", ".join(_GEOMETRY_FIELDS[self.attention])
            hint = f"an {self.attention.value.upper()} geometry needs {needed}"
            if len(missing) == 1:
                raise MissingFieldError(missing[0], hint=f" ({hint})")
            problems: list[ConfigError] = [MissingFieldError(name) for name in missing]
            raise_problems(problems, "engine config", footer=f"\n({hint})")
        if self.attention is AttentionKind.MLA:
            return KVGeometry.mla(
                num_layers=self.num_layers or 0,
                kv_lora_rank=self.kv_lora_rank or 0,
                qk_rope_head_dim=self.qk_rope_head_dim or 0,
                dtype=self.dtype,
                page_size=self.page_size,
            )
        return KVGeometry.mha(
            num_layers=self.num_layers or 0,
            num_kv_heads=self.num_kv_heads or 0,
            head_dim=self.head_dim or 0,
            dtype=self.dtype,
            page_size=self.page_size,
        )

    def with_geometry_defaults(self) -> tuple[EngineConfig, list[str]]:
        """Fill missing geometry fields from :data:`GEOMETRY_DEFAULTS`, saying which.

        For ``kvtier check`` without a model at hand; engines always pass their geometry.
        """
        filled = {name: GEOMETRY_DEFAULTS[self.attention][name] for name in self.missing_geometry()}
        if not filled:
            return self, []
        text = ", ".join(f"{k}={v}" for k, v in filled.items())
        return self.model_copy(update=filled), [f"geometry not given, defaults used: {text}"]


def load_engine_config(
    value: str | Mapping[str, Any] | EngineConfig | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    source: str = "config",
) -> EngineConfig:
    """Build an EngineConfig from JSON text, ``@file``, a mapping or None, plus overrides.

    ``overrides`` replace top-level keys (the CLI's flags over ``--config``); ``source``
    names the text in syntax errors.
    """
    if isinstance(value, EngineConfig):
        data: dict[str, Any] = value.model_dump(exclude_defaults=True)
    else:
        data = parse_extra_config(value, source=source)
    data.update(overrides or {})
    return EngineConfig.from_mapping(data)
