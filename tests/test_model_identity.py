"""The model's part of every engine's key namespace (``kvtier/core/model_identity.py``) and
the local files it is computed from (``kvtier/core/local_files.py``).

Each input that changes a page's bytes changes the digest; what cannot be keyed is
refused at start-up with the setting and the fix; the digest is the same in another
process. The engines' adapters are checked in ``test_vllm_inputs.py`` (vLLM) and
``test_sglang_keys.py`` (SGLang).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.core.errors import UnkeyableInputError, UnsupportedCombinationError
from kvtier.core.local_files import SMALL_FILE, local_files
from kvtier.core.model_identity import ModelInputs, identify, weights_identity

ROOT = Path(__file__).resolve().parent.parent


def safetensors(path: Path, tensors: dict[str, list[int]], *, pad: int = 0) -> Path:
    """A safetensors file of float32 ``tensors`` (name -> shape), zeros, ``pad`` bytes of
    extra data after them (a file above :data:`SMALL_FILE` where asked)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in tensors.items():
        size = 4
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    data = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(len(data).to_bytes(8, "little") + data)
        handle.truncate(8 + len(data) + offset + pad)
    return path


def model_folder(root: Path, **files: bytes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"hidden_size": 64}))
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def hub_repo(cache: Path, repo: str, commit: str, files: dict[str, bytes]) -> Path:
    """A Hugging Face hub cache entry: ``snapshots/<commit>/NAME -> ../../blobs/<hash>``."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        import hashlib

        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


BASE = ModelInputs(name="org/model", revision="a" * 40, config={"hidden_size": 64})


# --- every input changes the digest -------------------------------------------------------


class _Impl(enum.Enum):
    VLLM = "vllm"


@dataclasses.dataclass
class _QuantArgs:
    bits: int


@pytest.mark.parametrize(
    "change",
    [
        {"revision": "b" * 40},
        {"config": {"hidden_size": 64, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}},
        {"config": {"hidden_size": 64, "rope_theta": 500000.0}},
        {"dtype": "float16"},
        {"kv_cache_dtype": "fp8_e4m3"},
        {"quantization": "fp8"},
        {"load_format": "safetensors"},
        {"settings": {"calculate_kv_scales": True}},
        {"settings": {"json_model_override_args": {"rope_theta": 1.0}}},
        {"settings": {"model_impl": _Impl.VLLM}},
        {"settings": {"quantization_config": _QuantArgs(bits=4)}},
        {"name": "org/other"},
    ],
    ids=lambda change: next(iter(change)) + ":" + str(next(iter(change.values())))[:20],
)
def test_each_input_changes_the_digest(change: dict[str, Any]) -> None:
    assert identify(dataclasses.replace(BASE, **change)) != identify(BASE)


def test_the_same_inputs_give_the_same_identity_whatever_their_order() -> None:
    a = dataclasses.replace(BASE, settings={"x": {"b": 1, "a": [1, 2]}, "y": None})
    b = dataclasses.replace(BASE, settings={"y": None, "x": {"a": [1, 2], "b": 1}})
    assert identify(a) == identify(b)
    assert identify(BASE).startswith("org/model#")
    torch = pytest.importorskip("torch")
    assert identify(dataclasses.replace(BASE, dtype=torch.bfloat16)) == identify(
        dataclasses.replace(BASE, dtype="bfloat16")
    )
    assert identify(dataclasses.replace(BASE, load_format=None)) == identify(
        dataclasses.replace(BASE, load_format="auto")
    )


def test_the_identity_is_the_same_in_another_process(tmp_path: Path) -> None:
    model = model_folder(tmp_path / "m", **{"tokenizer.json": b"{}"})
    safetensors(model / "sub" / "model.safetensors", {"w": [4, 4]}, pad=SMALL_FILE)
    code = (
        "import sys; from kvtier.core.model_identity import ModelInputs, identify; "
        f"print(identify(ModelInputs(name='m', local_path={str(model)!r}, "
        "settings={'b': {'y': 1, 'x': 2}, 'a': [3]})))"
    )
    here = identify(
        ModelInputs(name="m", local_path=str(model), settings={"a": [3], "b": {"x": 2, "y": 1}})
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here


def test_a_declared_identity_keys_everything_but_the_weights(tmp_path: Path) -> None:
    one = model_folder(tmp_path / "one", **{"model.safetensors": b"weights one"})
    two = model_folder(tmp_path / "two", **{"model.safetensors": b"weights two"})
    first = identify(ModelInputs(name=str(one), declared="llama@v1", local_path=str(one)))
    assert first == identify(ModelInputs(name=str(two), declared="llama@v1", local_path=str(two)))
    assert first.startswith("llama@v1#")
    quantized = ModelInputs(name=str(two), declared="llama@v1", quantization="fp8")
    assert identify(quantized) != first


# --- weights: every file, every sub-folder, by content identity ----------------------------


def test_weights_in_sub_folders_are_keyed(tmp_path: Path) -> None:
    model = model_folder(tmp_path / "m")
    shard = safetensors(model / "part" / "model-00001.safetensors", {"w": [8, 8]})
    first = weights_identity(model, what="model")
    assert weights_identity(model, what="model") == first
    safetensors(shard, {"w": [8, 9]})  # another shape in a sub-folder
    assert weights_identity(model, what="model") != first
    (model / "deeper").mkdir()
    (model / "deeper" / "extra.bin").write_bytes(b"x")
    assert weights_identity(model, what="model") != first
    # hidden tool state (.git, .cache) is not an input
    before = weights_identity(model, what="model")
    (model / ".cache").mkdir()
    (model / ".cache" / "download.lock").write_text("now")
    assert weights_identity(model, what="model") == before


def test_a_large_safetensors_file_is_keyed_by_its_header_not_its_weights(tmp_path: Path) -> None:
    model = model_folder(tmp_path / "m")
    weights = safetensors(model / "model.safetensors", {"w": [4, 4]}, pad=SMALL_FILE)
    first = weights_identity(model, what="model")
    reads: list[int] = []
    real_open = open

    class Counting:
        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.handle.close()

        def read(self, size: int = -1) -> bytes:
            data = self.handle.read(size)
            reads.append(len(data))
            return bytes(data)

    def counting_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(path, mode, *args, **kwargs)
        return Counting(handle) if Path(path) == weights.resolve() else handle

    import kvtier.core.local_files as module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "open", counting_open, raising=False)
        assert weights_identity(model, what="model") == first
    assert 0 < sum(reads) < 4096  # the 8-byte length and the JSON header only
    safetensors(weights, {"w": [4, 4], "b": [4]}, pad=SMALL_FILE)  # another header
    assert weights_identity(model, what="model") != first


def test_hub_snapshots_of_the_same_blobs_share_an_identity(tmp_path: Path) -> None:
    files = {"config.json": b'{"hidden_size": 64}', "model.safetensors": b"weights"}
    one = hub_repo(tmp_path / "hub1", "org/model", "a" * 40, files)
    two = hub_repo(tmp_path / "hub2", "org/model", "b" * 40, files)
    other = hub_repo(
        tmp_path / "hub3", "org/model", "c" * 40, {**files, "model.safetensors": b"w2"}
    )
    assert weights_identity(one, what="m") == weights_identity(two, what="m")
    assert weights_identity(other, what="m") != weights_identity(one, what="m")


# --- refusals -----------------------------------------------------------------------------


def test_dummy_weights_are_refused() -> None:
    for declared in (None, "llama@v1"):
        with pytest.raises(UnsupportedCombinationError) as refused:
            identify(dataclasses.replace(BASE, declared=declared, load_format="dummy"))
        message = str(refused.value)
        assert "--load-format dummy" in message and "random values" in message
        assert "--load-format auto" in message


def test_weights_from_elsewhere_need_a_declared_identity() -> None:
    with pytest.raises(UnsupportedCombinationError) as refused:
        identify(dataclasses.replace(BASE, load_format="runai_streamer"))
    message = str(refused.value)
    assert "--load-format runai_streamer" in message and "do not come from local files" in message
    assert '"kvtier": {"model": "NAME"}' in message
    declared = dataclasses.replace(BASE, declared="m@v1", load_format="runai_streamer")
    assert identify(declared).startswith("m@v1#")


def test_a_setting_without_a_stable_value_is_refused() -> None:
    with pytest.raises(UnsupportedCombinationError) as refused:
        identify(dataclasses.replace(BASE, settings={"hf_overrides": lambda config: config}))
    message = str(refused.value)
    assert "cannot key the engine setting hf_overrides" in message
    assert "as plain data" in message
    with pytest.raises(UnsupportedCombinationError, match=r"setting the model's config\.x"):
        identify(dataclasses.replace(BASE, config={"x": object()}))


def test_a_model_neither_local_nor_pinned_is_refused() -> None:
    with pytest.raises(UnsupportedCombinationError) as refused:
        identify(ModelInputs(name="org/model"))
    message = str(refused.value)
    assert "cannot key the pages of model 'org/model'" in message
    assert "--revision COMMIT" in message and "a local model directory" in message


# --- links ----------------------------------------------------------------------------------


def test_links_that_cannot_be_keyed_are_refused_naming_the_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    cases = {
        "dangling": lambda root: (root / "w.bin").symlink_to(root / "missing"),
        "loop": lambda root: (
            (root / "a").symlink_to(root / "b"),
            (root / "b").symlink_to(root / "a"),
        ),
        "outside": lambda root: (root / "w.bin").symlink_to(outside),
        "device": lambda root: (root / "w.bin").symlink_to("/dev/zero"),
        "folder loop": lambda root: (root / "sub").symlink_to(root),
        "fifo": lambda root: os.mkfifo(root / "w.bin"),
    }
    words = {
        "dangling": "which does not exist",
        "loop": "loops",
        "outside": f"outside {tmp_path}",
        "device": "outside",
        "folder loop": "a loop",
        "fifo": "neither a file nor a folder",
    }
    for case, make in cases.items():
        root = tmp_path / case.replace(" ", "-")
        model_folder(root)
        make(root)
        with pytest.raises(UnkeyableInputError) as refused:
            local_files(root, what=f"LoRA adapter {case!r}")
        message = str(refused.value)
        assert message.startswith(f"LoRA adapter {case!r}: kvtier cannot key it"), case
        assert words[case] in message, (case, message)
        assert str(root) in message, case  # the link is named
        with pytest.raises(UnsupportedCombinationError) as at_start_up:
            identify(ModelInputs(name=str(root), local_path=str(root)))
        assert words[case] in str(at_start_up.value), case


def test_links_inside_the_folder_are_followed(tmp_path: Path) -> None:
    root = model_folder(tmp_path / "m", **{"real.bin": b"data"})
    (root / "shared").mkdir()
    (root / "shared" / "w.bin").write_bytes(b"weights")
    (root / "alias.bin").symlink_to("real.bin")
    (root / "view").symlink_to("shared")
    names = [f.name for f in local_files(root, what="m")]
    assert names == ["alias.bin", "config.json", "real.bin", "shared/w.bin", "view/w.bin"]
