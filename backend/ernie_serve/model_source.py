"""`--model` as FastDeploy takes it: a local checkpoint directory, or a model id fetched from FD_MODEL_SOURCE.

Resolved once, before anything loads (ernie-serve before tritonserver starts, LLM before its engine), so every
consumer gets a local directory and a failure is one message naming the id, the source and what was tried.

Sources are FastDeploy's names. HUGGINGFACE (the default here, docs/deployments.md says why) goes through
huggingface_hub's snapshot_download into the shared Hugging Face cache, so HF_HOME / HF_HUB_CACHE, HF_ENDPOINT,
HF_HUB_OFFLINE and HF_TOKEN mean what they mean to vLLM or transformers, and a download shows its progress bar.
MODELSCOPE and AISTUDIO go through their own clients (`modelscope`, `aistudio-sdk`), which are not dependencies of
this package: without them the id is refused, naming what to install. FD_MODEL_CACHE, where set, is FastDeploy's
download directory (`$FD_MODEL_CACHE/<repo id>`) for every source; the non-HF sources default to `~/<repo id>`
as FastDeploy's do.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

SOURCES = ("HUGGINGFACE", "MODELSCOPE", "AISTUDIO")
DEFAULT_SOURCE = "HUGGINGFACE"


class ModelNotFoundError(ValueError):
    """`--model` names neither a local directory nor an id its source could fetch; the message says which."""


def model_source() -> str:
    """FD_MODEL_SOURCE, checked against FastDeploy's values (upper-cased, as a user may write it either way)."""
    raw = os.environ.get("FD_MODEL_SOURCE", "").strip()
    source = raw.upper() or DEFAULT_SOURCE
    if source not in SOURCES:
        raise ModelNotFoundError(f"FD_MODEL_SOURCE={raw!r} is not a model source: use one of {', '.join(SOURCES)}")
    return source


def looks_like_path(model: str) -> bool:
    """A path, not an id: it starts like one, has more parts than org/name, or its first part exists here.

    So a typo in a local path is reported missing instead of being sent to a hub as an id."""
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model:
        return True
    return "/" in model and Path(model.split("/", 1)[0]).exists()


def resolve_model(model: str | None, flag: str = "--model") -> str | None:
    """The local directory `model` names: itself when it is one, else the id fetched from FD_MODEL_SOURCE.
    None / empty stays as it is (the embedded tiny model)."""
    if model is None or not str(model).strip():
        return model
    model = str(model).strip()
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ModelNotFoundError(f"{flag} {model} is a file; give the checkpoint's directory (the one holding "
                                 f"config.json and tokenizer.model)")
    if looks_like_path(model):
        raise ModelNotFoundError(f"{flag} {model}: no such directory (a local path, so it is not looked up as a "
                                 f"model id)")
    source = model_source()
    local = FETCHERS[source](model, flag)
    log.info("%s %s: %s (FD_MODEL_SOURCE=%s)", flag, model, local, source)
    return local


# ---------------------------------------------------------------- sources
def _fd_cache_dir(repo_id: str, default_home: bool) -> Path | None:
    """FastDeploy's download directory for a repo: $FD_MODEL_CACHE/<repo id>, else ~/<repo id> where FastDeploy
    puts it for this source (default_home), else None (the source's own cache)."""
    root = os.environ.get("FD_MODEL_CACHE") or (str(Path.home()) if default_home else None)
    return Path(root).expanduser() / repo_id if root else None


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def from_huggingface(model: str, flag: str = "--model") -> str:
    """snapshot_download into the shared cache (or FD_MODEL_CACHE/<id>); offline, the cache alone answers."""
    # FastDeploy's AISTUDIO/MODELSCOPE ids are PaddlePaddle/..., the same checkpoints are baidu/... on the hub
    repo_id = "baidu/" + model.split("/", 1)[1] if model.lower().startswith("paddlepaddle/") else model
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ModelNotFoundError(f"{flag} {model}: FD_MODEL_SOURCE=HUGGINGFACE needs huggingface_hub "
                                 f"(pip install huggingface_hub)") from None
    local_dir = _fd_cache_dir(repo_id, default_home=False)
    where = f"FD_MODEL_CACHE's {local_dir}" if local_dir else f"the Hugging Face cache {constants.HF_HUB_CACHE}"
    tried = (f"{where} only (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE
             else f"{where}, then {constants.ENDPOINT}")
    try:
        return str(snapshot_download(repo_id, local_dir=local_dir))
    except Exception as e:  # noqa: BLE001 - every hub failure becomes the one message below
        raise ModelNotFoundError(f"{flag} {model}: not a local directory, and FD_MODEL_SOURCE=HUGGINGFACE could "
                                 f"not fetch {repo_id} (tried {tried}): {_first_line(e)}") from None


def _paddle_repo_id(model: str) -> str:
    """AI Studio and ModelScope host ERNIE under PaddlePaddle/ where the hub has baidu/ (FastDeploy maps it)."""
    return "PaddlePaddle/" + model.split("/", 1)[1] if model.lower().startswith("baidu/") else model


def _from_client(source: str, package: str, module: str, model: str, flag: str) -> str:
    import importlib

    repo_id = _paddle_repo_id(model)
    try:
        download = importlib.import_module(module).snapshot_download
    except ImportError:
        raise ModelNotFoundError(f"{flag} {model}: FD_MODEL_SOURCE={source} needs its client, which is not "
                                 f"installed: pip install {package} (or FD_MODEL_SOURCE=HUGGINGFACE, or give a local "
                                 f"directory)") from None
    local_dir = _fd_cache_dir(repo_id, default_home=True)
    try:
        got = download(repo_id=repo_id, local_dir=str(local_dir))
    except Exception as e:  # noqa: BLE001 - every client failure becomes the one message below
        raise ModelNotFoundError(f"{flag} {model}: not a local directory, and FD_MODEL_SOURCE={source} could not "
                                 f"fetch {repo_id} into {local_dir}: {_first_line(e)}") from None
    return str(got) if isinstance(got, (str, Path)) and Path(got).is_dir() else str(local_dir)


def from_modelscope(model: str, flag: str = "--model") -> str:
    return _from_client("MODELSCOPE", "modelscope", "modelscope.hub.snapshot_download", model, flag)


def from_aistudio(model: str, flag: str = "--model") -> str:
    return _from_client("AISTUDIO", "aistudio-sdk", "aistudio_sdk.snapshot_download", model, flag)


FETCHERS: dict[str, Callable[[str, str], str]] = {"HUGGINGFACE": from_huggingface, "MODELSCOPE": from_modelscope,
                                                  "AISTUDIO": from_aistudio}
