"""Checks of ``kvtier bench`` options against this machine, made before a run starts.

The options parser knows types; these know the machine: whether the torch device exists
here, whether the work directory and the plot file can be written, whether the pools fit
in memory and the pages on disk. Each mistake is one :class:`ConfigError` naming the
option, what was wrong and what would work, raised before anything is allocated, so a
mistake never costs a run or its results.
"""

from __future__ import annotations

import difflib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from kvtier.core.errors import ConfigError, InvalidFieldError

__all__ = [
    "PLOT_HINT",
    "available_host_bytes",
    "check_device_runs",
    "check_disk",
    "check_memory",
    "check_plot",
    "check_seed",
    "make_workdir",
    "resolve_device",
]

PLOT_HINT = "pip install 'kvtier[plot]' (or pip install matplotlib)"
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
GIB = 2**30


def _first_line(exc: BaseException, limit: int = 120) -> str:
    """The exception's type and the start of its first sentence (torch's run for pages)."""
    lines = str(exc).strip().splitlines()
    text = lines[0].split(". ")[0] if lines else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def resolve_device(text: str | None) -> torch.device:
    """The torch device ``--device`` names (default: cuda when usable, else cpu), checked.

    Refuses a name torch does not know, CUDA on a torch build or machine without it, a
    device index that does not exist, and any other device torch cannot allocate on.
    """
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        close = difflib.get_close_matches(text.split(":")[0], _DEVICE_TYPES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidFieldError(
            "--device",
            f"{text!r} is not a torch device{hint}; use cpu, or cuda / cuda:N on a machine "
            "with a CUDA build of torch",
            value=text,
        ) from None
    if device.type == "cuda":
        _check_cuda(text, device)
    elif device.type != "cpu":
        try:
            torch.empty(1, device=device)
        except Exception as exc:  # torch raises several types for a device it cannot use
            raise InvalidFieldError(
                "--device",
                f"{text!r} cannot be used here ({_first_line(exc)}); use --device cpu",
                value=text,
            ) from None
    return device


def _check_cuda(text: str, device: torch.device) -> None:
    if torch.version.cuda is None:
        raise InvalidFieldError(
            "--device",
            f"{text!r} needs CUDA, but this torch ({torch.__version__}) was built without it; "
            "use --device cpu, or install a CUDA build of torch",
            value=text,
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise InvalidFieldError(
            "--device",
            f"{text!r}: no CUDA device is visible on this machine{where}; use --device cpu",
            value=text,
        )
    if device.index is not None and device.index >= count:
        raise InvalidFieldError(
            "--device",
            f"{text!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}",
            value=text,
        )


def check_device_runs(device: torch.device, io_backend: str, devices: frozenset[str]) -> None:
    """Refuse a device the plan's IO backend does not run on (``devices`` from its spec)."""
    if device.type not in devices:
        raise InvalidFieldError(
            "--device",
            f"{str(device)!r}: IO backend {io_backend!r} runs on {', '.join(sorted(devices))}; "
            "use one of those devices, or an --io-backend that runs on this one "
            "(`kvtier backends` lists them)",
            value=str(device),
        )


#: Seeds go to torch generators (64-bit), plus a small per-round offset.
MAX_SEED = 2**62 - 1


def check_seed(seed: int) -> None:
    """``--seed`` must fit a torch generator, with room for the per-round offsets."""
    if not 0 <= seed <= MAX_SEED:
        raise InvalidFieldError(
            "--seed", f"must be an integer from 0 to 2**62 - 1, got {seed}", value=seed
        )


def make_workdir(base: str | None, prefix: str) -> Path:
    """A fresh private directory under ``--workdir`` (or the system temp dir), or why not."""
    if base is not None and not Path(base).is_dir():
        raise InvalidFieldError(
            "--workdir",
            f"{base!r} is not a directory; give an existing writable directory, or leave "
            "--workdir out to use the system temp dir",
            value=base,
        )
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    except OSError as exc:
        where = base if base is not None else tempfile.gettempdir()
        fix = (
            "give a writable directory"
            if base is not None
            else "set TMPDIR or --workdir to a writable directory"
        )
        raise InvalidFieldError(
            "--workdir",
            f"cannot create a directory in {where!r} ({exc.strerror or _first_line(exc)}); {fix}",
            value=where,
        ) from None


def check_plot(path: str | None, workload: str) -> None:
    """``--plot``: only the multiturn workload draws one; matplotlib and the file must work.

    The file is opened for writing (and removed again if it did not exist) so that a
    directory that is missing or read-only is found now, not after the run.
    """
    if path is None:
        return
    if workload != "multiturn":
        raise InvalidFieldError(
            "--plot",
            f"the {workload} workload has nothing to plot (its table is the whole result); "
            "add --workload multiturn to plot throughput and hit rates per turn, or drop "
            "--plot",
            value=path,
        )
    if not path.lower().endswith(".png"):
        raise InvalidFieldError("--plot", f"must name a .png file, got {path!r}", value=path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"--plot {path} needs matplotlib, which is not installed; install it with "
            f"{PLOT_HINT}, or drop --plot",
            value=path,
        ) from None
    target = Path(path)
    existed = target.exists()
    try:
        with target.open("ab"):
            pass
    except OSError as exc:
        raise InvalidFieldError(
            "--plot",
            f"cannot write {path!r} ({exc.strerror or _first_line(exc)}); name a .png file "
            "in an existing writable directory",
            value=path,
        ) from None
    if not existed:
        target.unlink(missing_ok=True)


def available_host_bytes() -> int | None:
    """Host memory available to a new allocation (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(
    host_bytes: int,
    device_bytes: int,
    device: torch.device,
    *,
    what: str,
    fix: str,
    available: int | None = None,
) -> None:
    """Refuse a run whose pools cannot fit: host memory, and the GPU's for a CUDA device.

    ``what`` names what the bytes are for, ``fix`` the options that shrink them;
    ``available`` replaces the measured host memory (for tests).
    """
    on_host = host_bytes + (device_bytes if device.type == "cpu" else 0)
    free = available_host_bytes() if available is None else available
    if free is not None and on_host > free:
        raise ConfigError(
            f"the run needs {on_host / GIB:.1f} GiB of host memory ({what}), but "
            f"{free / GIB:.1f} GiB is available; {fix}",
            value=on_host,
        )
    if device.type == "cuda" and device_bytes:
        gpu_free, _ = torch.cuda.mem_get_info(device)
        if device_bytes > gpu_free:
            raise ConfigError(
                f"the run needs {device_bytes / GIB:.1f} GiB on {device}, but "
                f"{gpu_free / GIB:.1f} GiB is free there; {fix}",
                value=device_bytes,
            )


def check_disk(path: Path, needed: int, *, what: str, fix: str) -> None:
    """Refuse a run whose files cannot fit in the free space under ``path``."""
    free = shutil.disk_usage(path).free
    if needed > free:
        raise ConfigError(
            f"the run writes {needed / GIB:.1f} GiB to {str(path)!r} ({what}), but "
            f"{free / GIB:.1f} GiB is free there; {fix}",
            value=needed,
        )
