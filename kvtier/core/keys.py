"""Page keys: chained, namespaced, rank-aware hashes over token ids, in a safe charset.

A page key names the KV of one full page *and every page before it*: key ``i`` is a keyed
BLAKE2b of key ``i - 1``'s chain state and the token ids of page ``i``. The BLAKE2b key is
the namespace digest (model, geometry fingerprint, tenant), so two namespaces run two
unrelated keyed hash functions; the namespace id is also the key's prefix. Partial pages
get no key: their KV is not final.

Every key that reaches a storage backend passes :func:`validate_key`: 1 to
:data:`MAX_KEY_LENGTH` characters of ``[a-z0-9_-]``, starting with a letter or digit, so
no key can name a path outside a backend's root (no ``/``, ``.``, NUL or empty key).
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from kvtier.core.errors import InvalidFieldError, InvalidKeyError
from kvtier.core.geometry import AttentionKind
from kvtier.core.layout import Layout

__all__ = [
    "KEY_CHARSET",
    "MAX_KEY_LENGTH",
    "NAMESPACE_ID_CHARS",
    "Namespace",
    "PageKeyer",
    "external_key",
    "layout_namespace",
    "rank_suffix",
    "token_bytes",
    "validate_key",
    "validate_keys",
]

#: The characters a page key may contain (a key must also start with a letter or digit).
KEY_CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789-_"
#: The longest key accepted; leaves room under the usual 255-byte file-name limit.
MAX_KEY_LENGTH = 160

_KEY_RE = re.compile(r"[a-z0-9][a-z0-9_-]*")
_CHARSET_TEXT = (
    f"1 to {MAX_KEY_LENGTH} characters from [a-z0-9_-] (lowercase letters, digits, "
    "'-' and '_'), starting with a letter or digit"
)
_DIGEST_BYTES = 32
#: The characters of a namespace id, the prefix of every key of the namespace.
NAMESPACE_ID_CHARS = 16
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_TOKEN_ITEMSIZE = 4


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is in the key charset; raise :class:`InvalidKeyError`."""
    if not isinstance(key, str):
        raise InvalidKeyError(
            f"page key must be a str, got {type(key).__name__} {key!r}; keys are {_CHARSET_TEXT}",
            value=key,
        )
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(
            f"page key {key[:40]!r}... is {len(key)} characters long; keys are {_CHARSET_TEXT}",
            value=key,
        )
    if not _KEY_RE.fullmatch(key):
        raise InvalidKeyError(f"invalid page key {key!r}; keys are {_CHARSET_TEXT}", value=key)
    return key


#: A whole batch of valid keys, each followed by a newline (never in a key): one regex
#: pass checks them all.
_BATCH_RE = re.compile(rf"(?:[a-z0-9][a-z0-9_-]{{0,{MAX_KEY_LENGTH - 1}}}\n)*")


def validate_keys(keys: Sequence[str]) -> list[str]:
    """:func:`validate_key` for a batch, as a list; raise on the first invalid key.

    One regular-expression pass over the joined batch (a batch's hot path); when it
    fails, the keys are checked one by one, so the error names the culprit.
    """
    checked = list(keys)
    try:
        batch = "\n".join(checked) + "\n" if checked else ""
    except TypeError:  # a key that is not a str: checked one by one below
        batch = "\0"
    # (the count: a newline inside a key would otherwise pass as two keys)
    if batch.count("\n") == len(checked) and _BATCH_RE.fullmatch(batch):
        return checked
    for key in checked:
        validate_key(key)
    return checked


@dataclass(frozen=True)
class Namespace:
    """Who a page belongs to: model, geometry fingerprint and optional tenant salt.

    ``tenant`` separates tenants that share one store; kept secret, it also stops one
    tenant from predicting (and probing for) another's keys.
    """

    model: str
    geometry_fingerprint: str
    tenant: str | None = field(default=None, repr=False)  # a salt: kept out of logs

    def __post_init__(self) -> None:
        for name in ("model", "geometry_fingerprint"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidFieldError(
                    f"namespace.{name}", f"must be a non-empty str, got {value!r}", value=value
                )
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise InvalidFieldError(
                "namespace.tenant",
                f"must be a str or None, got {self.tenant!r}",
                value=self.tenant,
            )

    @cached_property
    def digest(self) -> bytes:
        """32 bytes of BLAKE2b over the fields, unambiguously encoded; the hash key."""
        canonical = json.dumps(
            ["kvtier-namespace-v1", self.model, self.geometry_fingerprint, self.tenant],
            ensure_ascii=True,
            separators=(",", ":"),
        )
        return hashlib.blake2b(canonical.encode("ascii"), digest_size=_DIGEST_BYTES).digest()

    @property
    def id(self) -> str:
        """16 hex digits of :attr:`digest`: the stable, charset-safe prefix of every key."""
        return self.digest[: NAMESPACE_ID_CHARS // 2].hex()


def _check_tokens(tokens_min: int, tokens_max: int) -> None:
    if tokens_min < _INT32_MIN or tokens_max > _INT32_MAX:
        bad = tokens_min if tokens_min < _INT32_MIN else tokens_max
        raise InvalidKeyError(
            f"token id {bad} does not fit in int32; page keys hash token ids as int32",
            value=bad,
        )


def _little_endian(data: bytes) -> bytes:
    if sys.byteorder == "little":
        return data
    swapped = array.array("i")
    swapped.frombytes(data)
    swapped.byteswap()
    return swapped.tobytes()


def _numpy() -> Any:
    """The numpy module if it is installed (an optional speed-up), else None."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy ships with torch almost everywhere
        return None
    return numpy


def _array_bytes(array_like: Any, tokens: object) -> bytes:
    """Little-endian int32 bytes of a numpy integer array (numpy is not imported here)."""
    kind = array_like.dtype.kind
    if kind not in "iu":
        raise InvalidKeyError(
            f"token ids must be an integer array, got dtype {array_like.dtype}", value=tokens
        )
    flat = array_like.reshape(-1)
    if flat.size and not (kind == "i" and flat.dtype.itemsize <= _TOKEN_ITEMSIZE):
        _check_tokens(int(flat.min()), int(flat.max()))
    return bytes(flat.astype("<i4", copy=False).tobytes())


def _tensor_bytes(tokens: torch.Tensor) -> bytes:
    """Little-endian int32 bytes of an integer tensor (on any device)."""
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise InvalidKeyError(
            f"token ids must be an integer tensor, got dtype {tokens.dtype}", value=tokens
        )
    flat = tokens.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    try:
        # numpy's reductions are single-threaded; torch's spin OpenMP threads, which is
        # slow on a busy host for a vector this small.
        return _array_bytes(flat.numpy(), tokens)
    except (RuntimeError, TypeError):  # torch without numpy, or a dtype numpy lacks
        pass
    if flat.dtype != torch.int32:
        if flat.numel():
            _check_tokens(int(flat.min()), int(flat.max()))
        flat = flat.to(torch.int32)
    flat = flat.contiguous()
    return _little_endian(ctypes.string_at(flat.data_ptr(), flat.numel() * _TOKEN_ITEMSIZE))


def token_bytes(tokens: Sequence[int] | torch.Tensor | Any) -> bytes:
    """The token ids as little-endian int32 bytes, converted once for a whole sequence."""
    if isinstance(tokens, torch.Tensor):
        return _tensor_bytes(tokens)
    if hasattr(tokens, "__array_interface__") and hasattr(tokens, "astype"):
        return _array_bytes(tokens, tokens)
    if not isinstance(tokens, (list, tuple, range)):
        tokens = list(tokens)
    numpy = _numpy()
    if numpy is not None and len(tokens):
        # numpy converts a list of ints several times faster than array.array does.
        try:
            converted = numpy.asarray(tokens)
        except (ValueError, TypeError, OverflowError):
            converted = None
        if converted is not None and converted.dtype.kind in "iu":
            return _array_bytes(converted, tokens)
    return _packed_bytes(tokens)


def _packed_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian int32 bytes through the standard library (no numpy)."""
    try:
        packed = array.array("i", tokens)
    except OverflowError as exc:
        raise InvalidKeyError(
            f"a token id does not fit in int32 ({exc}); page keys hash token ids as int32",
            value=None,
        ) from None
    except TypeError as exc:
        raise InvalidKeyError(f"token ids must be integers: {exc}", value=None) from None
    if packed.itemsize != _TOKEN_ITEMSIZE:  # pragma: no cover - exotic C int
        raise InvalidKeyError("this platform's C int is not 32 bits", value=None)
    return _little_endian(packed.tobytes())


def rank_suffix(attention: AttentionKind | str, tp_rank: int, tp_size: int) -> str:
    """``_r<rank>of<size>`` where ranks hold different heads (MHA under TP), else ``""``.

    MLA ranks hold the same latent, so their pages are shared and carry no suffix.
    """
    per_rank = AttentionKind(attention) is AttentionKind.MHA and tp_size > 1
    return f"_r{tp_rank}of{tp_size}" if per_rank else ""


def layout_namespace(
    model: str, layout: Layout | str, fingerprint: str, tenant: str | None = None
) -> Namespace:
    """The namespace of the pages a (model, host-pool layout, geometry, tenant) writes.

    The layout orders a page's bytes, so the same tokens stored from two layouts are two
    different pages: the layout is part of the namespace, never shared by two layouts.
    """
    return Namespace(f"{model}|{Layout(layout).value}", fingerprint, tenant)


def external_key(namespace: Namespace, raw: str, rank_suffix: str = "") -> str:
    """Namespace an engine's own page hash (SGLang's) into a validated kvtier key.

    ``raw`` must itself be in the key charset. The ``-x-`` marker keeps external keys
    apart from chained ones, whose character after the prefix is always a hex digit.
    """
    validate_key(raw)
    if rank_suffix and not re.fullmatch(r"_r[0-9]+of[0-9]+", rank_suffix):
        raise InvalidKeyError(
            f"rank suffix {rank_suffix!r} is not of the form '_r<rank>of<size>' (or '')",
            value=rank_suffix,
        )
    return validate_key(f"{namespace.id}-x-{raw}{rank_suffix}")


class PageKeyer:
    """Derives the chained keys of a token sequence's full pages for one rank."""

    def __init__(
        self,
        namespace: Namespace,
        page_size: int,
        attention: AttentionKind | str = AttentionKind.MHA,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        for name, value in (("page_size", page_size), ("tp_size", tp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidFieldError(
                    name, f"must be a positive integer, got {value!r}", value=value
                )
        if (
            isinstance(tp_rank, bool)
            or not isinstance(tp_rank, int)
            or not (0 <= tp_rank < tp_size)
        ):
            raise InvalidFieldError(
                "tp_rank", f"must be an integer in [0, {tp_size}), got {tp_rank!r}", value=tp_rank
            )
        self.namespace = namespace
        self.page_size = page_size
        self.attention = AttentionKind(attention)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        #: ``_r<rank>of<size>`` where ranks hold different heads (MHA under TP), else "".
        self.rank_suffix = rank_suffix(self.attention, tp_rank, tp_size)
        self._prefix = f"{namespace.id}-"
        self._hasher = hashlib.blake2b(key=namespace.digest, digest_size=_DIGEST_BYTES)
        iv = self._hasher.copy()
        iv.update(b"kvtier-chain-iv-v1")
        self._iv = iv.digest()

    def keys(
        self,
        tokens: Sequence[int] | torch.Tensor | Any,
        *,
        parent: str | None = None,
        extras: Sequence[bytes | None] | None = None,
    ) -> list[str]:
        """Keys of every full page of ``tokens``; ``parent`` continues from a known page key.

        ``extras`` (one entry per full page) carries what else changes a page's KV besides
        its tokens, such as the multimodal inputs whose placeholders it holds: a non-empty
        entry is folded into that page's hash, length-prefixed after its fixed-size token
        bytes; ``None`` or ``b""`` leaves the key exactly what the tokens alone give.
        """
        data = memoryview(token_bytes(tokens))
        prev = self._iv if parent is None else self._chain_state(parent)
        step = self.page_size * _TOKEN_ITEMSIZE
        pages = len(data) // step
        if extras is not None and len(extras) != pages:
            raise InvalidKeyError(
                f"extras has {len(extras)} entries for {pages} full pages of tokens; give "
                "one (bytes or None) per full page",
                value=len(extras),
            )
        base, prefix, suffix = self._hasher, self._prefix, self.rank_suffix
        out: list[str] = []
        for page in range(pages):
            start = page * step
            h = base.copy()
            h.update(prev)
            h.update(data[start : start + step])
            extra = extras[page] if extras is not None else None
            if extra:
                h.update(len(extra).to_bytes(8, "little"))
                h.update(extra)
            prev = h.digest()
            out.append(prefix + prev.hex() + suffix)
        return out

    def external(self, raw: str) -> str:
        """:func:`external_key` with this keyer's namespace and rank suffix."""
        return external_key(self.namespace, raw, self.rank_suffix)

    def _chain_state(self, key: str) -> bytes:
        validate_key(key)
        body = key[len(self._prefix) : len(key) - len(self.rank_suffix)]
        if (
            not key.startswith(self._prefix)
            or not key.endswith(self.rank_suffix)
            or len(body) != 2 * _DIGEST_BYTES
            or not re.fullmatch(r"[0-9a-f]+", body)
        ):
            raise InvalidKeyError(
                f"parent key {key!r} was not made by this keyer (namespace {self.namespace.id}, "
                f"rank suffix {self.rank_suffix!r})",
                value=key,
            )
        return bytes.fromhex(body)
