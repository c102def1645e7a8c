"""KV geometry: what one token's KV looks like, the bytes per page, and a stable fingerprint.

The fingerprint goes into every stored page, so a page written for one model shape can
never be loaded into another. It depends only on the fields below, spelled canonically,
never on Python's ``hash`` or on the machine.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import torch

from kvtier.core.errors import InvalidFieldError

__all__ = ["DTYPES", "AttentionKind", "KVGeometry", "dtype_from_name", "dtype_name"]


class AttentionKind(str, enum.Enum):
    """MHA/GQA keeps separate K and V per KV head; MLA keeps one latent vector per token."""

    MHA = "mha"
    MLA = "mla"

    def __str__(self) -> str:
        return self.value


def _float8_dtypes() -> dict[str, torch.dtype]:
    found: dict[str, torch.dtype] = {}
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            found[name] = dtype
    return found


#: The dtypes a KV page may hold, by canonical name. float8 pages move as raw bytes.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    **_float8_dtypes(),
}
_ALIASES = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Return the torch dtype for a canonical name or a common alias (``bf16``, ``fp8``)."""
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        name = str(name).removeprefix("torch.")
    key = _ALIASES.get(name, name)
    if key not in DTYPES:
        from kvtier.core.errors import did_you_mean

        raise InvalidFieldError(
            "dtype",
            f"unsupported dtype {name!r}{did_you_mean(name, DTYPES)}; "
            f"supported: {', '.join(DTYPES)}",
            value=name,
        )
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of a supported dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise InvalidFieldError("dtype", f"unsupported dtype {dtype}", value=dtype)


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidFieldError(name, f"must be a positive integer, got {value!r}", value=value)


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one rank's KV cache.

    For MHA, ``num_kv_heads`` is this rank's share of the KV heads under tensor
    parallelism and ``head_dim`` the size of one head. For MLA, ``num_kv_heads`` is 1 and
    ``head_dim`` is ``kv_lora_rank + qk_rope_head_dim``; build it with :meth:`mla`.
    """

    attention: AttentionKind
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", AttentionKind(self.attention))
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            _positive(name, getattr(self, name))
        if self.attention is AttentionKind.MLA and self.num_kv_heads != 1:
            raise InvalidFieldError(
                "num_kv_heads",
                f"MLA keeps one latent vector per token, so num_kv_heads must be 1, "
                f"got {self.num_kv_heads}",
                value=self.num_kv_heads,
            )

    @classmethod
    def mha(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str = torch.bfloat16,
        page_size: int = 64,
    ) -> KVGeometry:
        """An MHA/GQA geometry: separate K and V, ``num_kv_heads`` heads on this rank."""
        return cls(
            AttentionKind.MHA, num_layers, num_kv_heads, head_dim, dtype_from_name(dtype), page_size
        )

    @classmethod
    def mla(
        cls,
        *,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype | str = torch.bfloat16,
        page_size: int = 64,
    ) -> KVGeometry:
        """An MLA geometry: one latent vector of ``kv_lora_rank + qk_rope_head_dim``."""
        _positive("kv_lora_rank", kv_lora_rank)
        _positive("qk_rope_head_dim", qk_rope_head_dim)
        return cls(
            AttentionKind.MLA,
            num_layers,
            1,
            kv_lora_rank + qk_rope_head_dim,
            dtype_from_name(dtype),
            page_size,
        )

    @property
    def kv_count(self) -> int:
        """2 for MHA (K and V), 1 for MLA (the latent)."""
        return 2 if self.attention is AttentionKind.MHA else 1

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes of one of K, V or the latent, for one token in one layer."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.kv_count * self.num_layers * self.token_bytes_per_layer

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the canonical description; stable everywhere."""
        canonical = (
            f"kvtier-geometry-v1|{self.attention.value}|layers={self.num_layers}"
            f"|heads={self.num_kv_heads}|head_dim={self.head_dim}"
            f"|dtype={dtype_name(self.dtype)}|page={self.page_size}"
        )
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:16]

    def describe(self) -> str:
        """One line for logs and the CLI."""
        return (
            f"{self.attention.value.upper()} layers={self.num_layers} "
            f"kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
            f"dtype={dtype_name(self.dtype)} page_size={self.page_size} "
            f"({self.bytes_per_page} bytes/page, fingerprint {self.fingerprint})"
        )
