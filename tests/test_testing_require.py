"""``kvtier.testing.require``: skip where an optional component is missing, fail where required."""

from __future__ import annotations

import pytest

from kvtier.testing import require
from kvtier.testing.optional import require_env_var

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _not_required(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI's own KVTIER_REQUIRE_* settings stay out of these tests."""
    for var in ("KVTIER_REQUIRE_WIDGET", "KVTIER_REQUIRE_MY_SDK", "MY_SDK_IN_CI"):
        monkeypatch.delenv(var, raising=False)


def test_a_component_that_can_run_lets_the_test_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    require("widget", None)
    monkeypatch.setenv("KVTIER_REQUIRE_WIDGET", "1")
    require("widget", None)  # required and there: nothing to say


def test_a_missing_component_skips_with_its_reason() -> None:
    with pytest.raises(pytest.skip.Exception, match="widget is unavailable here: no widget"):
        require("widget", "no widget on this host")


def test_a_required_missing_component_fails_and_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVTIER_REQUIRE_WIDGET", "1")
    with pytest.raises(pytest.fail.Exception) as failed:
        require("widget", "no widget on this host")
    assert str(failed.value) == (
        "KVTIER_REQUIRE_WIDGET=1 but widget is unavailable here: no widget on this host"
    )


@pytest.mark.parametrize("value", ["", "0", "true", "yes"])
def test_only_1_makes_a_component_required(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KVTIER_REQUIRE_WIDGET", value)
    with pytest.raises(pytest.skip.Exception):
        require("widget", "no widget on this host")


def test_a_third_party_names_its_own_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_REQUIRE_MY_SDK", "1")  # not the variable asked about
    with pytest.raises(pytest.skip.Exception):
        require("my-sdk", "not installed", env_var="MY_SDK_IN_CI")
    monkeypatch.setenv("MY_SDK_IN_CI", "1")
    with pytest.raises(pytest.fail.Exception, match=r"^MY_SDK_IN_CI=1 but my-sdk is unavailable"):
        require("my-sdk", "not installed", env_var="MY_SDK_IN_CI")


@pytest.mark.parametrize(
    ("component", "var"),
    [
        ("uring", "KVTIER_REQUIRE_URING"),
        ("Mooncake", "KVTIER_REQUIRE_MOONCAKE"),
        ("my-sdk", "KVTIER_REQUIRE_MY_SDK"),
        ("vendor.kernel v2", "KVTIER_REQUIRE_VENDOR_KERNEL_V2"),
    ],
)
def test_the_variable_is_named_after_the_component(component: str, var: str) -> None:
    assert require_env_var(component) == var


def test_a_component_name_needs_a_letter_or_digit() -> None:
    with pytest.raises(ValueError, match="no letters or digits"):
        require_env_var("--")


MODULE_NEEDING_A_WIDGET = """
from kvtier.testing import require

require("widget", "no widget on this host")


def test_never_runs():
    raise AssertionError("the module should have been skipped or failed")
"""


def test_at_module_level_it_skips_or_fails_the_whole_module(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_widget=MODULE_NEEDING_A_WIDGET)
    skipped = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    skipped.assert_outcomes(skipped=1)
    skipped.stdout.fnmatch_lines(["*widget is unavailable here: no widget on this host*"])
    monkeypatch.setenv("KVTIER_REQUIRE_WIDGET", "1")
    failed = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    failed.assert_outcomes(errors=1)
    failed.stdout.fnmatch_lines(["*KVTIER_REQUIRE_WIDGET=1 but widget is unavailable here*"])
