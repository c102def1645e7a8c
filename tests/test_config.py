"""The extra-config parser, model validation and EngineConfig: every error names its cause."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

from kvtier.core.config import (
    AUTO,
    DEFAULT_BACKEND,
    GEOMETRY_DEFAULTS,
    EngineConfig,
    load_engine_config,
)
from kvtier.core.config_docs import config_reference_markdown, describe_fields
from kvtier.core.errors import (
    ConfigError,
    ExtraConfigSyntaxError,
    InvalidFieldError,
    MissingFieldError,
    NotAnObjectError,
    UnknownKeyError,
)
from kvtier.core.extra_config import parse_extra_config
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.specs import Operation
from kvtier.core.validation import validate_model

DOCS = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def syntax_error(text: str) -> ExtraConfigSyntaxError:
    with pytest.raises(ExtraConfigSyntaxError) as info:
        parse_extra_config(text)
    return info.value


# --- accepted forms ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "", "   ", "\n\t"])
def test_nothing_is_an_empty_config(value: str | None) -> None:
    assert parse_extra_config(value) == {}


def test_json_object_string() -> None:
    text = '{"capacity_bytes": 1024, "nested": {"a": [1, 2.5, null, true]}}'
    assert parse_extra_config(text) == {
        "capacity_bytes": 1024,
        "nested": {"a": [1, 2.5, None, True]},
    }


def test_mapping_is_copied_not_shared() -> None:
    source = {"a": 1}
    parsed = parse_extra_config(MappingProxyType(source))
    parsed["b"] = 2
    assert parsed == {"a": 1, "b": 2} and source == {"a": 1}


def test_json_file(tmp_path: Path) -> None:
    path = tmp_path / "backend.json"
    path.write_text('\ufeff{"capacity_bytes": 7}\n', encoding="utf-8")  # a BOM is tolerated
    assert parse_extra_config(f"@{path}") == {"capacity_bytes": 7}
    assert parse_extra_config(f"  @ {path}  ") == {"capacity_bytes": 7}


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "backend.TOML"
    path.write_text('root = "/tmp/kv"\ncapacity_bytes = 7\n[tier]\nfast = true\n')
    assert parse_extra_config(f"@{path}") == {
        "root": "/tmp/kv",
        "capacity_bytes": 7,
        "tier": {"fast": True},
    }


def test_empty_file_is_an_empty_config(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text("  \n")
    assert parse_extra_config(f"@{path}") == {}


# --- syntax errors: position, caret, hint ------------------------------------------------


def test_single_quotes() -> None:
    err = syntax_error("{'capacity_bytes': 1}")
    assert (err.line, err.column) == (1, 2)
    assert err.source == "extra-config"
    lines = str(err).splitlines()
    assert lines[0] == (
        "extra-config: invalid JSON at line 1, column 2: "
        "Expecting property name enclosed in double quotes"
    )
    assert lines[1] == "    {'capacity_bytes': 1}"
    assert lines[2] == "     ^"
    assert "hint: JSON needs double quotes around keys and strings" in str(err)
    assert err.value == "{'capacity_bytes': 1}"


def test_trailing_comma() -> None:
    err = syntax_error('{"a": 1,}')
    assert (err.line, err.column) == (1, 9)
    assert str(err).splitlines()[2] == "    " + " " * 8 + "^"
    assert "hint: remove the trailing comma" in str(err)


def test_pasted_python_dict() -> None:
    err = syntax_error('{"o_direct": True, "root": None}')
    assert "pasted Python dict" in str(err)
    assert "true, false and null in lower case" in str(err)


def test_key_equals_value() -> None:
    err = syntax_error("capacity_bytes=1024")
    assert "not key=value" in str(err)
    assert "@file.toml" in str(err)


def test_shell_ate_the_quotes() -> None:
    # What bash passes for --extra-config {"capacity_bytes": 1} without single quotes.
    err = syntax_error("{capacity_bytes: 1}")
    assert "the shell removed them" in str(err)
    assert "--extra-config '{\"key\": 1}'" in str(err)


def test_unquoted_string_value() -> None:
    err = syntax_error('{"root": /tmp/kv}')
    assert "string values need double quotes too" in str(err)


def test_typographic_quotes() -> None:
    err = syntax_error("{\u201croot\u201d: 1}")
    assert "typographic quotes" in str(err)


def test_truncated_text() -> None:
    err = syntax_error('{"a": 1')
    assert "ends early" in str(err)


def test_path_without_at() -> None:
    err = syntax_error("conf/backend.json")
    assert "prefix its path with @: @conf/backend.json" in str(err)


def test_multiline_position() -> None:
    text = '{\n  "a": 1,\n  "b": [1 2]\n}'
    err = syntax_error(text)
    assert (err.line, err.column) == (3, 11)
    lines = str(err).splitlines()
    assert lines[0].startswith("extra-config: invalid JSON at line 3, column 11")
    assert lines[1] == '      "b": [1 2]'
    assert lines[2] == "    " + " " * 10 + "^"


def test_long_line_keeps_the_caret_in_view() -> None:
    text = '{"k": "' + "x" * 300 + '", "bad": tru}'
    err = syntax_error(text)
    snippet, caret = str(err).splitlines()[1:3]
    assert len(snippet) < 100
    assert snippet[caret.index("^")] == "t"  # the caret still points at 'tru'


def test_duplicate_key_is_rejected_not_overwritten() -> None:
    err = syntax_error('{"a": 1,\n "a": 2}')
    assert "key 'a' is given twice" in str(err)
    assert err.line == 2


def test_huge_integer_is_a_config_error() -> None:
    with pytest.raises(ExtraConfigSyntaxError, match="invalid JSON"):
        parse_extra_config('{"a": ' + "9" * 5000 + "}")


def test_deep_nesting_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_extra_config("[" * 100_000)


def test_toml_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('root = "/tmp"\nfsync = page\n')
    with pytest.raises(ExtraConfigSyntaxError) as info:
        parse_extra_config(f"@{path}")
    err = info.value
    assert err.line == 2
    assert err.source == f"extra-config (@{path})"
    text = str(err)
    assert f"extra-config (@{path}): invalid TOML at line 2, column" in text
    assert "    fsync = page" in text
    assert 'TOML strings need quotes: key = "value"' in text


def test_json_in_a_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('{"a": 1}')
    with pytest.raises(ExtraConfigSyntaxError, match="this file holds JSON, not TOML"):
        parse_extra_config(f"@{path}")


def test_json_file_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "a": 1,\n}\n')
    with pytest.raises(ExtraConfigSyntaxError) as info:
        parse_extra_config(f"@{path}", source="--extra-config")
    assert str(info.value).startswith(f"--extra-config (@{path}): invalid JSON at line 3")


# --- file errors ------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=r"file '.*nope\.json' does not exist") as info:
        parse_extra_config(f"@{path}")
    assert str(path) in str(info.value)


def test_wrong_extension(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"must end in \.json or \.toml \(got '\.yaml'\)"):
        parse_extra_config(f"@{tmp_path}/backend.yaml")


def test_directory_is_not_readable(tmp_path: Path) -> None:
    folder = tmp_path / "dir.json"
    folder.mkdir()
    with pytest.raises(ConfigError, match="cannot read file") as info:
        parse_extra_config(f"@{folder}")
    assert str(folder) in str(info.value)


def test_at_without_path() -> None:
    with pytest.raises(ConfigError, match="'@' must be followed by a file path"):
        parse_extra_config("@")


def test_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        parse_extra_config(f"@{path}")


# --- not an object ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[1, 2]", "got array [1, 2]"),
        ('"s"', "got string 's'"),
        ("3", "got number 3"),
        ("null", "got null None"),
        ("true", "got boolean True"),
    ],
)
def test_not_an_object(text: str, named: str) -> None:
    with pytest.raises(NotAnObjectError) as info:
        parse_extra_config(text)
    assert "must be a JSON object" in str(info.value)
    assert named in str(info.value)


@pytest.mark.parametrize("value", [[1], 3, b"{}"])
def test_wrong_python_type(value: Any) -> None:
    with pytest.raises(NotAnObjectError, match=f"got {type(value).__name__}"):
        parse_extra_config(value)


def test_mapping_with_non_string_keys() -> None:
    with pytest.raises(NotAnObjectError, match="keys must be strings, got 1"):
        parse_extra_config({1: "a"})  # type: ignore[dict-item]


# --- property: nothing but ConfigError ----------------------------------------------------

_JSONISH = st.text(alphabet="{}[]\":,'0123456789.-+eE truefalsnNoTF\\=@\n\t\u201c", max_size=40)
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def _parse_or_config_error(text: str) -> None:
    try:
        result = parse_extra_config(text)
    except ConfigError:
        return
    assert isinstance(result, dict)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_parses_or_raises_config_error(text: str) -> None:
    _parse_or_config_error(text)


@settings(max_examples=300, deadline=None)
@given(_JSONISH)
def test_jsonish_text_parses_or_raises_config_error(text: str) -> None:
    _parse_or_config_error(text)


@settings(max_examples=200, deadline=None)
@given(
    _JSON_VALUES,
    st.integers(min_value=0, max_value=200),
    st.sampled_from(["", ",", "'", "}", "True", "="]),
)
def test_damaged_json_parses_or_raises_config_error(value: Any, where: int, insert: str) -> None:
    text = json.dumps(value)
    cut = where % (len(text) + 1)
    damaged = text[:cut] + insert + text[cut + 1 :]
    _parse_or_config_error(damaged)
    if isinstance(value, dict):
        assert parse_extra_config(text) == value


# --- validate_model -----------------------------------------------------------------------


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int = 1


class Opts(BaseModel):
    model_config = ConfigDict(extra="forbid")
    capacity_bytes: int = 1024
    root: str
    inner: Inner = Field(default_factory=Inner)


def test_unknown_key_lists_allowed_keys_and_suggests() -> None:
    with pytest.raises(UnknownKeyError) as info:
        validate_model(Opts, {"root": "/x", "capacity_byte": 3}, where="extra_config")
    err = info.value
    assert err.key == "capacity_byte"
    assert err.allowed == ("capacity_bytes", "inner", "root")
    assert str(err) == (
        "unknown key 'capacity_byte' in extra_config (did you mean 'capacity_bytes'?); "
        "allowed keys: 'capacity_bytes', 'inner', 'root'"
    )


def test_unknown_nested_key_uses_the_nested_model() -> None:
    with pytest.raises(UnknownKeyError) as info:
        validate_model(Opts, {"root": "/x", "inner": {"sise": 3}}, where="extra_config")
    assert info.value.where == "extra_config.inner"
    assert "(did you mean 'size'?); allowed keys: 'size'" in str(info.value)


def test_wrong_type_names_the_field_path() -> None:
    with pytest.raises(InvalidFieldError) as info:
        validate_model(Opts, {"root": "/x", "capacity_bytes": "lots"}, where="extra_config")
    assert info.value.path == "extra_config.capacity_bytes"
    assert str(info.value).startswith(
        "extra_config.capacity_bytes: Input should be a valid integer"
    )
    assert "got 'lots'" in str(info.value)
    assert info.value.value == "lots"


def test_nested_wrong_type_path() -> None:
    with pytest.raises(InvalidFieldError) as info:
        validate_model(Opts, {"root": "/x", "inner": {"size": []}}, where="extra_config")
    assert info.value.path == "extra_config.inner.size"


def test_missing_field() -> None:
    with pytest.raises(MissingFieldError) as info:
        validate_model(Opts, {}, where="extra_config")
    assert str(info.value) == "extra_config.root: required field is missing"


def test_top_level_paths_have_no_prefix() -> None:
    with pytest.raises(MissingFieldError, match=r"^root: required field is missing"):
        validate_model(Opts, {}, where="")


def test_several_problems_in_one_message() -> None:
    with pytest.raises(ConfigError) as info:
        validate_model(Opts, {"capacity_bytes": "x", "colour": 1}, where="extra_config")
    err = info.value
    assert isinstance(err, UnknownKeyError)  # an unknown key (a typo) leads
    problems = err.problems  # type: ignore[attr-defined]
    assert [type(p) for p in problems] == [UnknownKeyError, InvalidFieldError, MissingFieldError]
    text = str(err)
    assert text.startswith("3 problems in extra_config:\n")
    assert "  - unknown key 'colour' in extra_config" in text
    assert "  - extra_config.capacity_bytes: Input should be a valid integer" in text
    assert "  - extra_config.root: required field is missing" in text


def test_data_must_be_a_mapping() -> None:
    with pytest.raises(NotAnObjectError, match="extra_config must be an object"):
        validate_model(Opts, [1, 2], where="extra_config")  # type: ignore[arg-type]


# --- EngineConfig -------------------------------------------------------------------------


def test_defaults() -> None:
    config = EngineConfig()
    assert config.backend == DEFAULT_BACKEND
    assert config.io_backend == AUTO and config.layout == AUTO
    assert config.attention is AttentionKind.MHA
    assert config.operations == (Operation.BACKUP_ALL, Operation.LOAD_ALL)
    assert config.extra_config == {} and config.verify == "full"
    assert (config.tp_rank, config.tp_size, config.page_size) == (0, 1, 64)


def test_frozen() -> None:
    config = EngineConfig()
    with pytest.raises(ValueError, match="frozen"):
        config.backend = "other"  # type: ignore[misc]


def test_from_json_string_with_extra_config_string() -> None:
    config = load_engine_config(
        json.dumps(
            {
                "backend": "file",
                "layout": "Page_First",
                "dtype": "bf16",
                "operations": ["load_layer", "backup_all"],
                "extra_config": '{"root": "/tmp/kv"}',
            }
        )
    )
    assert config.backend == "file"
    assert config.layout == "page_first"
    assert config.dtype == "bfloat16"
    assert config.operations == (Operation.LOAD_LAYER, Operation.BACKUP_ALL)
    assert config.extra_config == {"root": "/tmp/kv"}
    assert EngineConfig.from_json('{"model": "m"}').model == "m"


def test_whole_config_from_toml_file_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('backend = "file"\nnum_layers = 4\n[extra_config]\nroot = "/tmp/kv"\n')
    config = load_engine_config(f"@{path}", overrides={"num_layers": 8})
    assert (config.backend, config.num_layers) == ("file", 8)
    assert config.extra_config == {"root": "/tmp/kv"}


def test_engine_config_unknown_key() -> None:
    with pytest.raises(UnknownKeyError) as info:
        EngineConfig.from_mapping({"io_backed": "direct"})
    assert "unknown key 'io_backed' in engine config (did you mean 'io_backend'?)" in str(
        info.value
    )
    assert "'extra_config'" in str(info.value)


def test_engine_config_bad_extra_config_keeps_syntax_error() -> None:
    with pytest.raises(ExtraConfigSyntaxError) as info:
        EngineConfig.from_mapping({"extra_config": "{'root': 1}"})
    assert info.value.source == "extra_config"
    assert "line 1, column 2" in str(info.value) and "double quotes" in str(info.value)


def test_engine_config_extra_config_not_object() -> None:
    with pytest.raises(NotAnObjectError, match="extra_config must be a JSON object"):
        EngineConfig.from_mapping({"extra_config": "[1]"})


def test_strict_integers() -> None:
    with pytest.raises(InvalidFieldError, match=r"^num_layers: Input should be a valid integer"):
        EngineConfig.from_mapping({"num_layers": True})
    with pytest.raises(InvalidFieldError, match=r"^page_size: Input should be greater than 0"):
        EngineConfig.from_mapping({"page_size": 0})


def test_layout_did_you_mean() -> None:
    with pytest.raises(InvalidFieldError) as info:
        EngineConfig.from_mapping({"layout": "page_frist"})
    assert str(info.value) == (
        "layout: unknown layout 'page_frist' (did you mean 'page_first'?); choose one of "
        "auto, layer_first, page_first, page_first_direct, page_head"
    )


def test_bad_dtype_and_attention_and_operation() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_mapping(
            {"dtype": "bf61", "attention": "gqa", "operations": ["load_all", "load_layers"]}
        )
    text = str(info.value)
    assert "dtype: unsupported dtype 'bf61'" in text
    assert "attention: Input should be 'mha' or 'mla', got 'gqa'" in text
    assert "operations[1]: Input should be 'backup_all'" in text


def test_tp_rank_below_tp_size() -> None:
    with pytest.raises(InvalidFieldError) as info:
        EngineConfig.from_mapping({"tp_rank": 2, "tp_size": 2})
    assert str(info.value) == "tp_rank: must be below tp_size (2), got 2"


def test_host_pages_or_host_bytes() -> None:
    with pytest.raises(InvalidFieldError, match="host_bytes: give host_pages or host_bytes"):
        EngineConfig.from_mapping({"host_pages": 8, "host_bytes": 1 << 20})


def test_geometry_field_of_the_other_attention_kind() -> None:
    with pytest.raises(InvalidFieldError) as info:
        EngineConfig.from_mapping({"attention": "mla", "head_dim": 128})
    assert str(info.value).startswith(
        "head_dim: is an MHA geometry field but attention is "
        "'mla'; an MLA geometry takes num_layers, kv_lora_rank"
    )


def test_nested_engine_config_paths_are_prefixed() -> None:
    class Outer(BaseModel):
        model_config = ConfigDict(extra="forbid")
        engine: EngineConfig

    with pytest.raises(InvalidFieldError) as info:
        validate_model(Outer, {"engine": {"tp_rank": 1}}, where="cfg")
    assert info.value.path == "cfg.engine.tp_rank"


def test_geometry_mha_and_mla() -> None:
    mha = EngineConfig(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
    assert mha.geometry() == KVGeometry.mha(
        num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16
    )
    mla = EngineConfig(
        attention=AttentionKind.MLA, num_layers=3, kv_lora_rank=512, qk_rope_head_dim=64
    )
    geometry = mla.geometry()
    assert geometry == KVGeometry.mla(num_layers=3, kv_lora_rank=512, qk_rope_head_dim=64)
    assert geometry.head_dim == 576 and geometry.num_kv_heads == 1


def test_missing_geometry_names_every_field() -> None:
    with pytest.raises(MissingFieldError) as info:
        EngineConfig(num_layers=4).geometry()
    text = str(info.value)
    assert text.startswith("2 problems in engine config:")
    assert "num_kv_heads: required field is missing" in text
    assert "head_dim: required field is missing" in text
    assert "an MHA geometry needs num_layers, num_kv_heads, head_dim" in text
    assert info.value.path == "num_kv_heads"


def test_geometry_defaults_are_announced() -> None:
    config, notes = EngineConfig(attention=AttentionKind.MLA, num_layers=2).with_geometry_defaults()
    assert config.num_layers == 2
    assert config.kv_lora_rank == GEOMETRY_DEFAULTS[AttentionKind.MLA]["kv_lora_rank"]
    assert notes == ["geometry not given, defaults used: kv_lora_rank=512, qk_rope_head_dim=64"]
    full = EngineConfig(num_layers=1, num_kv_heads=1, head_dim=8)
    assert full.with_geometry_defaults() == (full, [])


# --- reference docs ---------------------------------------------------------------------


def test_describe_fields() -> None:
    docs = {d.name: d for d in describe_fields(Opts)}
    assert docs["root"].required and docs["root"].default_text() == "required"
    assert docs["capacity_bytes"].type == "int" and docs["capacity_bytes"].default == 1024
    assert docs["inner"].default == "size=1"  # a model default falls back to str()
    engine = {d.name: d for d in describe_fields(EngineConfig)}
    assert engine["attention"].type == '"mha" | "mla"'
    assert engine["tenant"].type == "str | None"
    assert engine["operations"].default == ["backup_all", "load_all"]


def test_docs_contain_the_generated_reference() -> None:
    assert config_reference_markdown() in DOCS.read_text(encoding="utf-8"), (
        "docs/configuration.md is out of date: paste config_reference_markdown() into it"
    )


def test_load_engine_config_from_a_config_with_overrides() -> None:
    base = EngineConfig(
        backend="file",
        attention=AttentionKind.MLA,
        num_layers=2,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        extra_config={"root": "/x"},
        operations=(Operation.LOAD_LAYER,),
    )
    copy = load_engine_config(base, overrides={"tp_size": 2})
    assert copy == base.model_copy(update={"tp_size": 2})


def test_load_engine_config_source_names_the_text() -> None:
    with pytest.raises(ExtraConfigSyntaxError, match=r"^--config: invalid JSON at line 1"):
        load_engine_config("{oops", source="--config")


_FIELD_NAMES = st.sampled_from([*EngineConfig.model_fields, "bakend", "extra"])


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        _FIELD_NAMES,
        _JSON_VALUES
        | st.sampled_from(["mla", "auto", "page_first", "{'a': 1}", "[1]", "@x.json", "bf16"]),
        max_size=6,
    )
)
def test_any_json_engine_config_loads_or_raises_config_error(data: dict[str, Any]) -> None:
    try:
        config = load_engine_config(json.dumps(data))
    except ConfigError as exc:
        assert str(exc)
        return
    assert isinstance(config, EngineConfig)


# --- fields the engine config shares with the engines' sections -----------------------------


def _engine_models() -> list[type[BaseModel]]:
    from kvtier.integrations.sglang.settings import SGLangSection
    from kvtier.integrations.vllm.settings import VLLMSection

    return [EngineConfig, VLLMSection, SGLangSection]


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("model", "", "kvtier.model: String should have at least 1 character, got ''"),
        ("tiers", [{"backend": " "}], "kvtier.tiers[0].backend: must be a non-empty name"),
        (
            "tenants",
            {"a": {"quota_bytes": 0}},
            "kvtier.tenants.a.quota_bytes: Input should be greater than 0, got 0",
        ),
    ],
)
def test_shared_fields_are_checked_alike_by_the_config_and_both_engines(
    field: str, value: Any, words: str
) -> None:
    for model in _engine_models():
        data = {field: value} if field == "tiers" else {"backend": "file", field: value}
        with pytest.raises(InvalidFieldError) as info:
            validate_model(model, data, where="kvtier", label="kvtier")
        assert str(info.value).startswith(words), model.__name__
        fields = model.model_fields
        assert fields["tiers"].get_default(call_default_factory=True) == ()
        assert fields["tenants"].get_default(call_default_factory=True) == {}


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (0, "greater than or equal to 1, got 0"),
        (65, "less than or equal to 64, got 65"),
        (True, "a valid integer, got True"),
        ("2", "a valid integer, got '2'"),
    ],
)
def test_both_engines_check_checksum_workers_alike(value: Any, words: str) -> None:
    sections = _engine_models()[1:]
    for section in sections:
        with pytest.raises(
            InvalidFieldError, match=f"^kvtier.checksum_workers: Input should be {words}"
        ):
            validate_model(
                section, {"backend": "file", "checksum_workers": value}, where="kvtier", label="x"
            )
    # each engine keeps its own default: vLLM's cores run the model, SGLang's have room
    defaults = [validate_model(s, {"backend": "file"}, where="kvtier", label="x") for s in sections]
    assert [d.checksum_workers for d in defaults] == [1, 4]  # type: ignore[attr-defined]
