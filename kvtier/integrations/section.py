"""The ``kvtier`` section an engine adapter reads from its engine's extra config.

SGLang (``--hicache-storage-backend-extra-config``) and vLLM
(``kv_connector_extra_config``) each carry kvtier's settings in a ``kvtier`` object. Both
adapters find it, parse it and validate its shared fields here, with kvtier's one
extra-config parser, so a mistake reads the same whichever engine an operator runs.
Each adapter subclasses :class:`EngineSection` with the fields only its engine has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvtier.core.bounded import DEFAULT_CALL_TIMEOUT_S, DEFAULT_MAX_ABANDONED
from kvtier.core.config import ModelId
from kvtier.core.errors import (
    InvalidFieldError,
    MissingFieldError,
    NotAnObjectError,
    did_you_mean,
)
from kvtier.core.extra_config import parse_extra_config

__all__ = ["OPTIONS_AT", "SECTION", "EngineSection", "backend_of_tiers", "find_section"]

#: The key of kvtier's own section in an engine's extra config.
SECTION = "kvtier"
#: Where the backend's options sit, as errors name them.
OPTIONS_AT = f"{SECTION}.extra_config"


class EngineSection(BaseModel):
    """The fields every engine's ``kvtier`` section has: backend, its options, keys, checks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(
        description="kvtier storage backend: 'file', 'uring', 'memory', 'mooncake' or a "
        "plugin's (`kvtier backends` lists them)."
    )
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="The backend's own options: a JSON object, a JSON object string, or "
        "'@file.json' / '@file.toml'.",
    )
    verify: Literal["full", "header"] = Field(
        "full",
        description="Page verification on load: 'full' checksums the payload, 'header' "
        "checks the envelope header only.",
    )
    tenant: str | None = Field(
        None, description="Tenant salt for the key namespace, so tenants never share pages."
    )
    model: ModelId | None = Field(
        None, description="Model id for the key namespace; default: the engine's."
    )
    backend_call_timeout_s: float | None = Field(
        DEFAULT_CALL_TIMEOUT_S,
        gt=0,
        description="Bound on each storage backend call; a call past it fails its batch "
        "(a miss, or a store not kept) and is counted as backend_timeouts; null: unbounded.",
    )
    max_abandoned_calls: int = Field(
        DEFAULT_MAX_ABANDONED,
        strict=True,
        ge=1,
        le=64,
        description="Backend calls that may be stuck past their bound at once; beyond it "
        "every call fails at once (backend_refused) until one returns.",
    )

    def page_store_options(self) -> dict[str, Any]:
        """The keyword arguments of ``open_page_store`` this section sets: the bounds on
        backend calls, and the checksum threads where the engine's section has them."""
        return {
            "backend_call_timeout_s": self.backend_call_timeout_s,
            "max_abandoned_calls": self.max_abandoned_calls,
            "checksum_workers": int(getattr(self, "checksum_workers", 1)),
        }

    @field_validator("extra_config", mode="before")
    @classmethod
    def _parse_extra(cls, value: Any) -> dict[str, Any]:
        return parse_extra_config(value, source=OPTIONS_AT)

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty backend name (`kvtier backends` lists them)")
        return value.strip()


def backend_of_tiers(data: Any) -> Any:
    """A section's raw fields with ``backend`` set from ``tiers`` (a ``before`` validator's
    body, for the engines whose section takes a chain of tiers).

    With ``tiers``, each tier names its backend and options, so ``backend`` reads as the
    first tier's and may not be given too (nor ``extra_config``); without, the fields pass
    as they are. A first tier without a backend name is left for ``tiers[0].backend``'s
    own error.
    """
    if not isinstance(data, Mapping) or not data.get("tiers"):
        return data
    both = sorted({"backend", "extra_config"} & set(data))
    if both:
        raise InvalidFieldError(
            both[0],
            "give either `backend` (with its `extra_config`) or `tiers`, not both: "
            "with `tiers`, each tier names its backend and options",
            value=data[both[0]],
        )
    tiers = data["tiers"]
    first = tiers[0] if isinstance(tiers, (list, tuple)) else None
    name = first.get("backend") if isinstance(first, Mapping) else getattr(first, "backend", None)
    return {**data, "backend": name if isinstance(name, str) and name.strip() else "-"}


def find_section(
    extra: Mapping[str, Any] | None, *, where: str, label: str, example: str, docs: str
) -> dict[str, Any]:
    """The parsed ``kvtier`` section of an engine's extra config; a clear error if absent.

    ``where`` names the engine's setting in errors (``"kv_connector_extra_config"``),
    ``label`` the section in parser errors, ``example`` a minimal section to suggest.
    The section may be an object, JSON text or ``@file``, as any extra-config.
    """
    if extra is not None and not isinstance(extra, Mapping):
        raise NotAnObjectError(
            f"{where} must be a JSON object, got {type(extra).__name__}", value=extra
        )
    if not extra or SECTION not in extra:
        present = [str(key) for key in (extra or {})]
        close = [key for key in present if did_you_mean(SECTION, [key])]
        found = f" (found {close[0]!r}: did you mean {SECTION!r}?)" if close else ""
        raise MissingFieldError(
            f"{where}.{SECTION}",
            hint=f'{found}; kvtier reads its settings from a "{SECTION}" object, e.g. '
            f'"{SECTION}": {example} (see {docs})',
        )
    return parse_extra_config(extra[SECTION], source=label)
