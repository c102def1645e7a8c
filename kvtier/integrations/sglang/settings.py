"""The ``kvtier`` section of SGLang's storage extra-config: its fields, and reading it.

One home for what an operator writes, so the docs table (generated from
:class:`SGLangSection`) and the errors of a bad section come from the same place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator

from kvtier.core.errors import InvalidFieldError, MissingFieldError
from kvtier.core.geometry import dtype_from_name, dtype_name
from kvtier.core.validation import validate_model
from kvtier.integrations.section import OPTIONS_AT, SECTION, EngineSection, find_section
from kvtier.plugins.registry import Registry

__all__ = ["DOCS", "LABEL", "OPTIONS_AT", "SECTION", "SGLangSection", "read_section"]

#: How parser errors name kvtier's section of SGLang's storage extra-config.
LABEL = "extra-config 'kvtier' section"
#: The page that documents the adapter, as errors and warnings point to it.
DOCS = "docs/sglang.md"


class SGLangSection(EngineSection):
    """The ``kvtier`` section of SGLang's ``--hicache-storage-backend-extra-config``."""

    model: str | None = Field(
        None,
        min_length=1,
        description="Model id for the key namespace; default: SGLang's model name.",
    )
    dtype: str | None = Field(
        None,
        description="The KV dtype, only for host pools that store KV as raw bytes "
        "(fp8 KV kept as uint8): 'float8_e4m3fn' or 'float8_e5m2'.",
    )
    checksum_workers: int = Field(
        4,
        strict=True,
        ge=1,
        le=64,
        description="Threads that checksum the pages of one batch in parallel (a SGLang "
        "host has cores to spare, and prefetch latency is on the request's path).",
    )

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return dtype_name(dtype_from_name(value.strip()))
        except InvalidFieldError as exc:
            raise ValueError(str(exc).removeprefix("dtype: ")) from None


def read_section(extra: Mapping[str, Any] | None, registry: Registry) -> SGLangSection:
    """The validated ``kvtier`` section of SGLang's extra-config.

    A missing or misspelt section, a missing backend (the error lists ``registry``'s
    backends), unknown keys and wrong types each raise kvtier's error naming the field.
    """
    section = find_section(
        extra,
        where="extra-config",
        label=LABEL,
        example='{"backend": "file"}',
        docs=DOCS,
    )
    if "backend" not in section:
        names = ", ".join(repr(name) for name in sorted(registry.backends))
        raise MissingFieldError(
            f"{SECTION}.backend",
            hint=f"; name the kvtier storage backend, one of {names} (see {DOCS})",
        )
    return validate_model(SGLangSection, section, where=SECTION, label=LABEL)
