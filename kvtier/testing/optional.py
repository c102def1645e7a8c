"""Tests that need an optional component: skipped where it is missing, failed where required.

CI sets ``KVTIER_REQUIRE_<COMPONENT>=1`` for what it installs (io_uring, Mooncake,
SGLang, vLLM, ...), so a component that silently went missing fails the run instead of
skipping its tests. pytest is imported only when a test is skipped or failed, so this
module (and :mod:`kvtier.testing`) imports where pytest is not installed.
"""

from __future__ import annotations

import os
import re

__all__ = ["require", "require_env_var"]


def require_env_var(component: str) -> str:
    """The variable that makes ``component`` required: ``KVTIER_REQUIRE_<COMPONENT>``.

    The name is upper-cased, with every run of characters other than letters and digits
    made one ``_`` (``"my-sdk"`` -> ``KVTIER_REQUIRE_MY_SDK``).
    """
    suffix = re.sub(r"[^0-9A-Za-z]+", "_", component).strip("_").upper()
    if not suffix:
        raise ValueError(f"component {component!r} has no letters or digits to name a variable")
    return f"KVTIER_REQUIRE_{suffix}"


def require(component: str, reason: str | None, *, env_var: str | None = None) -> None:
    """Let a test go on when ``reason`` is None; else skip it, or fail it if required.

    ``reason`` says why ``component`` cannot run here (``spec.unavailable_reason()``, a
    probe, an ImportError). The test fails instead of skipping when the environment
    variable ``env_var`` (default :func:`require_env_var` of ``component``) is ``"1"``, as
    CI sets it. Callable from a test, a fixture or a test module's top level (there it
    skips or fails the whole module).
    """
    if reason is None:
        return
    import pytest

    var = env_var or require_env_var(component)
    message = f"{component} is unavailable here: {reason}"
    if os.environ.get(var) == "1":
        pytest.fail(f"{var}=1 but {message}")
    pytest.skip(message, allow_module_level=True)
