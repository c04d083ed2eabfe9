"""What each model.py builds from its config.pbtxt parameters (empty `model` = the embedded tiny model)."""
from __future__ import annotations

import sys
from pathlib import Path

from .pb import engine_config_from_parameters

# ernie_moe's engine thread wakes from each device step wanting the GIL while the response loop or a sender holds
# it; CPython hands the GIL over only after the switch interval (5 ms by default: a third of a 15 ms decode step,
# all of it device idle time). scripts/bench_serving_path.py reports it as step stretch.
ENGINE_GIL_SWITCH_SECONDS = 0.0005


def model_dir(params: dict[str, str]) -> Path:
    if params.get("model", "").strip():
        return Path(params["model"].strip())
    from ..demo.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


def load_plugins(params: dict[str, str]) -> None:
    path = params.get("tool_parser_plugin", "").strip()
    if path:
        from ..parsers import load_parser_plugin

        load_parser_plugin(path)


def tokenizer_dir(params: dict[str, str]) -> Path:
    """The --tokenizer directory, else the model's."""
    tok = params.get("tokenizer", "").strip()
    return Path(tok) if tok else model_dir(params)


def load_tokenizer(params: dict[str, str]):
    from ..tokenizer import ErnieTokenizer

    return ErnieTokenizer.from_pretrained(tokenizer_dir(params))


def preprocessor(params: dict[str, str]):
    from .preprocess import Preprocessor

    cfg = engine_config_from_parameters(params)
    load_plugins(params)
    return Preprocessor(load_tokenizer(params), cfg.max_model_len, cfg.reasoning_parser, cfg.tool_call_parser,
                        cfg.chat_template)


def postprocessor(params: dict[str, str]):
    from .postprocess import Postprocessor

    load_plugins(params)
    return Postprocessor(load_tokenizer(params), ttl=float(params.get("state_ttl_seconds") or 600))


def engine_model(params: dict[str, str], metrics=None, parent_pid: int | None = None):
    from .disagg import engine_front
    from .engine_model import EngineModel

    cfg = engine_config_from_parameters(params)
    if cfg.model is None:
        cfg.model = str(model_dir(params))
    sys.setswitchinterval(ENGINE_GIL_SWITCH_SECONDS)
    return EngineModel(cfg, metrics, engine=engine_front(cfg), parent_pid=parent_pid)
