"""The served model's tokenizer in the one form sglang-router (smg) loads: a directory with a HF `tokenizer.json`.

ERNIE-4.5 ships a SentencePiece BPE `tokenizer.model`; the router's tokenizer factory takes `tokenizer.json` only
(it refuses `.model` files), and without one it tokenizes nothing for its `/v1/tokenize` and its gRPC pipeline. A
model directory that already has a `tokenizer.json` is used as it is. Otherwise the SentencePiece model is written
out as the equivalent HF BPE, once per content, under the git-ignored build folder:

- vocabulary: every piece at its own id; control / unknown pieces and the `added_tokens_decoder` entries of
  tokenizer_config.json (plus user-defined pieces) become added tokens, matched in the raw text before the model
  runs, as SentencePiece matches user-defined pieces and as ErnieTokenizer splits on added tokens;
- merges: for every ordinary piece, each split into two pieces of the vocabulary, ranked by the piece's score.
  SentencePiece BPE merges the adjacent pair whose joined piece scores highest; a HF merge list in that order
  makes the same choice, and the pieces never cross a user-defined one in either;
- normalizer: spaces become U+2581; byte fallback for characters outside the vocabulary.

That is SentencePiece exactly for the normalization the ERNIE tokenizers and the embedded model use (identity,
no dummy prefix, whitespace kept). Other normalizations are refused (`RouterTokenizerError`, naming the setting):
a router tokenizing differently from the replicas would be worse than none. One difference stays: a literal U+2581
in the text is a space marker to SentencePiece and to this file, while ErnieTokenizer encodes it as its bytes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

SP_SPACE = "\u2581"
# Probes of the SentencePiece normalizer (its proto needs a protobuf runtime the shim cannot count on): text and
# the setting that would change it.
_NORMALIZER_PROBES = {"a  b": "remove_extra_whitespaces", "\uff21\u2460": "a normalization rule other than identity"}


class RouterTokenizerError(ValueError):
    """The model's tokenizer cannot be written as an equivalent tokenizer.json."""


def router_tokenizer_dir(model_dir: str | Path, cache_root: Path | None = None) -> Path:
    """A directory holding `tokenizer.json` (+ tokenizer_config.json) equivalent to the model's tokenizer: the model
    directory itself when it has one, else the export of its tokenizer.model (made once, reused by content)."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        return model_dir
    model_file = model_dir / "tokenizer.model"
    if not model_file.is_file():
        raise RouterTokenizerError(f"{model_dir} has neither tokenizer.json nor tokenizer.model")
    sources = [model_file] + [model_dir / n for n in ("tokenizer_config.json", "special_tokens_map.json",
                                                      "added_tokens.json", "chat_template.jinja")]
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    root = cache_root if cache_root is not None else _default_cache_root()
    out = root / digest.hexdigest()[:20]
    if (out / "tokenizer.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer_json(model_dir), ensure_ascii=False),
                                            encoding="utf-8")
        for path in sources[1:]:
            if path.is_file():
                shutil.copyfile(path, tmp / path.name)
        try:
            os.rename(tmp, out)  # atomic; another replica may have won the race with identical content
        except OSError:
            if not (out / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _default_cache_root() -> Path:
    from ernie_serve.paths import build_dir

    return build_dir() / "router-tokenizers"


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _added_token(token_id: int, content: str, special: bool) -> dict[str, Any]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def tokenizer_json(model_dir: str | Path) -> dict[str, Any]:
    """The HF tokenizer.json document for the SentencePiece BPE model in `model_dir` (see the module doc)."""
    import sentencepiece as spm

    model_dir = Path(model_dir)
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    _check_normalizer(sp)
    config = _read_json(model_dir / "tokenizer_config.json")
    declared = {entry["content"]: bool(entry.get("special", False))
                for entry in (config.get("added_tokens_decoder") or {}).values()}
    declared.update({text: declared.get(text, False) for text in _read_json(model_dir / "added_tokens.json")})

    vocab: dict[str, int] = {}
    added: list[dict[str, Any]] = []
    ordinary: list[tuple[float, int, str]] = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        vocab.setdefault(piece, i)
        score = sp.get_score(i)
        if sp.is_control(i) or sp.is_unknown(i):
            added.append(_added_token(i, piece, True))
        elif piece in declared:
            added.append(_added_token(i, piece, declared[piece]))
        elif sp.is_byte(i) or sp.is_unused(i):
            continue
        elif score == 0.0 and math.copysign(1.0, score) > 0 and len(piece) > 1:
            # user-defined pieces score +0.0 (the best ordinary BPE piece scores -0.0): matched whole, never merged
            added.append(_added_token(i, piece, False))
        else:
            ordinary.append((score, i, piece))
    unknown = set(declared) - set(vocab)
    if unknown:
        raise RouterTokenizerError(f"tokenizer_config.json declares tokens outside tokenizer.model: {sorted(unknown)}")

    merges: list[list[str]] = []
    for _score, _i, piece in sorted(ordinary, key=lambda t: (-t[0], t[1])):
        splits = [(vocab[piece[:k]], vocab[piece[k:]], piece[:k], piece[k:]) for k in range(1, len(piece))
                  if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend([left, right] for _l, _r, left, right in sorted(splits))
    unk = sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SP_SPACE},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SP_SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def _check_normalizer(sp) -> None:
    """Refuse the SentencePiece settings this translation does not reproduce, naming them."""
    first = sp.encode("a", out_type=str)
    if first and first[0].startswith(SP_SPACE):
        raise RouterTokenizerError("tokenizer.model adds a dummy prefix (add_dummy_prefix); not translated")
    for text, setting in _NORMALIZER_PROBES.items():
        if sp.decode(sp.encode(text)) != text:
            raise RouterTokenizerError(f"tokenizer.model uses {setting}; not translated")

