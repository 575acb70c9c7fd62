"""Models by Hugging Face Hub id: ``--model ORG/NAME`` becomes a local snapshot directory.

Resolution happens in the frontend, once, before any engine process starts: the engine
(and every data-parallel replica, and every restart of one) is handed a local path and
never touches the network. The download shows huggingface_hub's progress bars on stderr and
fetches only what tidal reads (config, safetensors weights, tokenizer files, chat template).
huggingface_hub itself honours ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN``.

A name that is an existing directory is always a local model, and tidal's built-in names
(``tidal-tiny``, ...) never reach the Hub; anything else of the form ``ORG/NAME`` is a Hub id.
"""

from __future__ import annotations

import os
import re

# What tidal reads from a model repository. Everything else (PyTorch .bin weights, ONNX, GGUF,
# READMEs, images) is left on the Hub.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
]

# ORG/NAME as the Hub spells repository ids (huggingface_hub.utils.validate_repo_id's alphabet).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelNotAvailable(Exception):
    """The model cannot be found locally or fetched; the message is one line for the operator."""


def is_hub_id(name: str) -> bool:
    """True for ``ORG/NAME`` that is not a local directory (which always wins)."""
    if os.path.isdir(os.path.expanduser(name)):
        return False
    return _REPO_ID.fullmatch(name) is not None and ".." not in name


def resolve_hub_model(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """Download (or find in the cache) the snapshot of ``repo_id`` and return its directory.

    Blocking (network and disk). ``download_dir`` replaces the Hub cache directory, as vLLM's
    ``--download-dir`` does. Raises ``ModelNotAvailable`` for an unknown or gated repository,
    an unknown revision, or no network (or ``HF_HUB_OFFLINE=1``) with nothing cached.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                 allow_patterns=ALLOW_PATTERNS)
    except GatedRepoError:  # before RepositoryNotFoundError: it is a subclass
        raise ModelNotAvailable(f"model {where} is gated on the Hugging Face Hub: accept its licence on the "
                                "Hub and set HF_TOKEN to a token that has access") from None
    except RepositoryNotFoundError:
        raise ModelNotAvailable(f"no model {where} on the Hugging Face Hub (or it is private: set HF_TOKEN), "
                                "and no local directory of that name") from None
    except RevisionNotFoundError:
        raise ModelNotAvailable(f"model {repo_id} has no revision {revision!r} on the Hugging Face Hub") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):  # incl. a partial snapshot it cannot complete
        offline = _offline()
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub cannot be reached"
        raise ModelNotAvailable(f"model {where} is not in the Hub cache ({_cache_dir(download_dir)}) and {why}; "
                                "download it once with network access, or pass a local directory") from None
    except HfHubHTTPError as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelNotAvailable(f"cannot fetch model {where} from the Hugging Face Hub: {first_line}") from None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir(download_dir: str | None) -> str:
    from huggingface_hub import constants

    return download_dir or constants.HF_HUB_CACHE
