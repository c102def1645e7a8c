"""The files of a local folder as key material: every file, links followed, nothing outside.

A model or LoRA adapter is often a Hugging Face hub snapshot: ``snapshots/<commit>/`` holds
only symbolic links into ``blobs/``, named by content hash. Skipping links would key such a
folder by its name alone (two different adapters named ``sql`` would share pages), so
:func:`local_files` follows them, and refuses, naming the link and the fix, a link it could
not key safely: one that dangles or loops, leaves the folder's filesystem, resolves outside
the folder (the hub repository's folder for a snapshot), or names something other than a
file or folder (a device such as ``/dev/zero`` would be read without end).

:func:`file_identity` is what a weight file contributes: its hub blob name (a content hash)
where it links to one, a safetensors file's header with its size and modification time,
the contents of a small file.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.core.errors import UnkeyableInputError

__all__ = ["LocalFile", "file_digest", "file_identity", "hub_blob", "local_files"]

_DIGEST_BYTES = 16
_READ_BYTES = 1 << 20
#: Files up to this size are keyed by their whole contents (configs, code, tokenizers).
SMALL_FILE = 4 << 20
#: safetensors' own limit on a header's length.
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class LocalFile:
    """One regular file under a folder: its name there and what it resolves to."""

    #: Its path under the folder as listed (through links), ``/``-separated.
    name: str
    #: The regular file it is, links resolved.
    path: Path
    size: int
    mtime_ns: int


def _refuse(what: str, link: Path, reason: str, fix: str) -> UnkeyableInputError:
    return UnkeyableInputError(
        f"{what}: kvtier cannot key it by its files' contents, because {link} {reason}; {fix}",
        value=str(link),
    )


def _area(root: Path) -> Path:
    """Where links under ``root`` may point: ``root``, or for a hub snapshot
    (``<repo>/snapshots/<commit>``) the repository's folder, which holds ``blobs/``."""
    if root.is_dir() and root.parent.name == "snapshots":
        return root.parent.parent
    return root if root.is_dir() else root.parent


def _inside(path: Path, area: Path) -> bool:
    return path == area or area in path.parents


def _resolve(what: str, link: Path, area: Path, device: int) -> tuple[Path, os.stat_result]:
    """Where ``link`` leads, checked: it exists, does not loop, stays in ``area`` and on
    ``device``, and is a regular file or a folder."""
    fix = (
        "copy the files into the folder, or link the folder itself, so that every link "
        f"under it stays inside {area}"
    )
    try:
        real = link.resolve(strict=True)
    except FileNotFoundError:
        raise _refuse(
            what, link, f"is a symbolic link to {os.readlink(link)!r}, which does not exist", fix
        ) from None
    except (RuntimeError, OSError) as exc:  # ELOOP: RuntimeError before Python 3.13
        raise _refuse(what, link, f"is a symbolic link that loops ({exc})", fix) from None
    info = real.stat()
    if not _inside(real, area):
        raise _refuse(what, link, f"is a symbolic link to {real}, outside {area}", fix)
    if info.st_dev != device:
        raise _refuse(what, link, f"is a symbolic link to {real}, on another filesystem", fix)
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
        raise _refuse(
            what, link, f"leads to {real}, which is neither a file nor a folder", "remove it"
        )
    return real, info


def local_files(root: str | os.PathLike[str], *, what: str) -> list[LocalFile]:
    """Every regular file under ``root`` (``root`` itself when it is a file), sorted by
    name, following symbolic links checked as the module says; hidden entries (a name that
    starts with ``.``: ``.git``, ``.cache``) are tool state, not inputs, and are skipped.

    ``what`` names the input in errors (``"LoRA adapter 'sql' at /a"``). Raises
    :class:`~kvtier.core.errors.UnkeyableInputError` for a link it cannot key, and
    ``OSError`` for a file it cannot read.
    """
    start = Path(os.path.realpath(root))
    top = start.stat()
    area = _area(start)
    if stat.S_ISREG(top.st_mode):
        return [LocalFile(Path(root).name, start, top.st_size, top.st_mtime_ns)]
    out: list[LocalFile] = []
    # each folder with the folders above it (a link to one of those is a loop)
    pending: list[tuple[Path, str, frozenset[tuple[int, int]]]] = [
        (start, "", frozenset({(top.st_dev, top.st_ino)}))
    ]
    while pending:
        folder, prefix, above = pending.pop()
        with os.scandir(folder) as entries:
            listed = sorted(entries, key=lambda e: e.name)
        for entry in listed:
            if entry.name.startswith("."):
                continue
            path, name = Path(entry.path), prefix + entry.name
            if entry.is_symlink():
                real, info = _resolve(what, path, area, top.st_dev)
            else:
                real, info = path, entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                node = (info.st_dev, info.st_ino)
                if node in above:
                    raise _refuse(
                        what,
                        path,
                        f"leads back to the folder {real} above it (a loop)",
                        "remove the link",
                    )
                pending.append((real, f"{name}/", above | {node}))
            elif stat.S_ISREG(info.st_mode):
                out.append(LocalFile(name, real, info.st_size, info.st_mtime_ns))
            else:
                raise _refuse(what, path, "is neither a file nor a folder", "remove it")
    return sorted(out, key=lambda f: f.name)


def file_digest(path: Path) -> str:
    """32 hex digits of BLAKE2b over the whole contents of the regular file ``path``."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    with open(path, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        while chunk := handle.read(_READ_BYTES):
            h.update(chunk)
    return h.hexdigest()


def hub_blob(path: Path) -> str | None:
    """The content hash a Hugging Face hub cache names the file ``path`` by (the blob's
    name, for a file resolved into ``blobs/``), else None."""
    if path.parent.name == "blobs" and len(path.name) >= 40:
        return path.name
    return None


def _safetensors_header(path: Path, size: int) -> str | None:
    """A digest of a safetensors file's header (tensor names, dtypes, shapes, offsets and
    metadata): its 8-byte length and the JSON after it, not the weights; None when the
    file has no valid header."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            return None
        length = int.from_bytes(head, "little")
        if length > _MAX_HEADER or length + 8 > size:
            return None
        header = handle.read(length)
    if len(header) != length or not header.startswith(b"{"):
        return None
    return hashlib.blake2b(head + header, digest_size=_DIGEST_BYTES).hexdigest()


def file_identity(file: LocalFile) -> list[Any]:
    """What identifies ``file``'s contents without reading a large one whole.

    A hub blob: its content hash. A small file (:data:`SMALL_FILE`): a digest of its
    contents, so a copy is the same file. A safetensors file: its header, size and
    modification time. Any other large file: its size and modification time. The time is
    there because weights retrained in place keep their shapes (the same header and
    size): a file rewritten is another file, a copy elsewhere merely another key.
    """
    blob = hub_blob(file.path)
    if blob is not None:
        return [file.name, "blob", blob]
    if file.size <= SMALL_FILE:
        return [file.name, "data", file_digest(file.path)]
    header = (
        _safetensors_header(file.path, file.size) if file.name.endswith(".safetensors") else None
    )
    if header is not None:
        return [file.name, "safetensors", header, file.size, file.mtime_ns]
    return [file.name, "file", file.size, file.mtime_ns]
