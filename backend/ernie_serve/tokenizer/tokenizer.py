"""ERNIE-4.5 tokenizer: SentencePiece plus the HF-style added/special tokens the model repos ship.

Special tokens are matched in the text before SentencePiece sees it (as HF's slow tokenizers do), so
`<|im_start|>`, `<think>`, ... always become their single id, and each text segment between them is
SentencePiece-encoded on its own. Decoding is the mirror image: runs of ordinary ids go through
SentencePiece, special/added ids are written out as their literal text.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import sentencepiece as spm

from .chat_template import render_chat_template, select_template

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# SentencePiece's whitespace marker: a literal one in the text would come back as a space, so it is
# encoded through its byte-fallback pieces instead.
_SP_SPACE = "\u2581"


def _token_text(value: Any) -> str | None:
    """HF stores a token either as a string or as a serialized AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class ErnieTokenizer:
    """Encode/decode and chat-template rendering for one model directory."""

    def __init__(self, sp_model_file: str | Path, config: dict | None = None,
                 special_tokens_map: dict | None = None, added_tokens: dict[str, int] | None = None) -> None:
        self._sp = spm.SentencePieceProcessor(model_file=str(sp_model_file))
        self.config = dict(config or {})
        self._sp_size = self._sp.get_piece_size()

        # content -> id for every token matched literally in text; id -> content for decoding.
        self._added: dict[str, int] = {}
        special_contents: set[str] = set()
        for sid, entry in (self.config.get("added_tokens_decoder") or {}).items():
            self._added[entry["content"]] = int(sid)
            if entry.get("special", False):
                special_contents.add(entry["content"])
        self._added.update({k: int(v) for k, v in (added_tokens or {}).items()})

        names: dict[str, Any] = {n: self.config.get(n) for n in _SPECIAL_NAMES}
        extra = list(self.config.get("additional_special_tokens") or [])
        for key, value in (special_tokens_map or {}).items():
            if key == "additional_special_tokens":
                extra = list(value)
            elif key in _SPECIAL_NAMES:
                names[key] = value
        self.special_tokens: dict[str, str] = {}
        for name in _SPECIAL_NAMES:
            text = _token_text(names[name]) or self._sp_default(name)
            if text is not None:
                self.special_tokens[name] = text
        self.additional_special_tokens = [_token_text(t) for t in extra]
        special_contents.update(self.special_tokens.values())
        special_contents.update(self.additional_special_tokens)
        for text in special_contents:
            if text not in self._added:
                self._added[text] = self._require_piece(text)

        self._literal: dict[int, str] = {i: t for t, i in self._added.items()}
        for i in range(self._sp_size):  # control pieces (<s>, </s>) decode to "" in SentencePiece itself
            if self._sp.is_control(i) or self._sp.is_unknown(i):
                self._literal.setdefault(i, self._sp.id_to_piece(i))
        self.all_special_ids: set[int] = {self._added[t] for t in special_contents}
        self._size = max([self._sp_size] + [i + 1 for i in self._added.values()])
        ordered = sorted(self._added, key=len, reverse=True)
        self._split_re = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None
        self._space_bytes = self._byte_ids(_SP_SPACE)
        self.add_bos_token = bool(self.config.get("add_bos_token", True))
        self.add_eos_token = bool(self.config.get("add_eos_token", False))
        self._continuations: dict[int, str | None] = {}
        self._reference_piece = next((i for i in range(self._sp_size) if self._is_plain_piece(i)), None)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ErnieTokenizer":
        """Load `tokenizer.model` and whichever of the HF json files the directory has."""
        path = Path(path)
        model_file = path / "tokenizer.model"
        if not model_file.is_file():
            raise FileNotFoundError(f"no tokenizer.model in {path}; point to a model directory that has one")
        config = _read_json(path / "tokenizer_config.json")
        if "chat_template" not in config:  # newer HF repos keep the template in a file of its own
            if (path / "chat_template.jinja").is_file():
                config["chat_template"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
            elif (path / "chat_template.json").is_file():
                config["chat_template"] = _read_json(path / "chat_template.json")["chat_template"]
        return cls(model_file, config, _read_json(path / "special_tokens_map.json"),
                   _read_json(path / "added_tokens.json"))

    # ---- vocabulary -------------------------------------------------------------------------------

    def _sp_default(self, name: str) -> str | None:
        sid = {"bos_token": self._sp.bos_id, "eos_token": self._sp.eos_id,
               "unk_token": self._sp.unk_id, "pad_token": self._sp.pad_id}[name]()
        return self._sp.id_to_piece(sid) if sid >= 0 else None

    def _require_piece(self, text: str) -> int:
        sid = self._sp.piece_to_id(text)
        if self._sp.id_to_piece(sid) != text:
            raise ValueError(f"special token {text!r} is neither in the SentencePiece vocab nor in "
                             "added_tokens_decoder / added_tokens.json; the tokenizer files disagree")
        return sid

    def _byte_ids(self, text: str) -> list[int] | None:
        ids = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in text.encode("utf-8")]
        return ids if all(self._sp.is_byte(i) for i in ids) else None

    def __len__(self) -> int:
        return self._size

    @property
    def vocab_size(self) -> int:
        return self._size

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self._added[text]

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def token_to_id(self, token: str) -> int | None:
        if token in self._added:
            return self._added[token]
        sid = self._sp.piece_to_id(token)
        return sid if self._sp.id_to_piece(sid) == token else None

    def id_to_token(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id in self._literal:
            return self._literal[token_id]
        if 0 <= token_id < self._sp_size:
            return self._sp.id_to_piece(token_id)
        raise ValueError(f"token id {token_id} is out of range for this tokenizer (size {self._size})")

    def is_literal(self, token_id: int) -> bool:
        """Whether the id is written out as its own text (added, special and control tokens) rather than
        decoded by SentencePiece."""
        return int(token_id) in self._literal

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes a SentencePiece id adds to decoded text: its piece with `▁` as a space, or the one
        raw byte of a byte-fallback piece."""
        token_id = int(token_id)
        if self._sp.is_byte(token_id):
            return bytes([int(self._sp.id_to_piece(token_id)[3:5], 16)])  # "<0x41>"
        return self._sp.id_to_piece(token_id).replace(_SP_SPACE, " ").encode("utf-8")

    def get_vocab(self) -> dict[str, int]:
        vocab = {self._sp.id_to_piece(i): i for i in range(self._sp_size)}
        vocab.update(self._added)
        return vocab

    # ---- encode / decode --------------------------------------------------------------------------

    def _segments(self, text: str) -> Iterator[tuple[str, bool]]:
        """(segment, is_added_token) in order; empty plain segments are dropped."""
        parts = self._split_re.split(text) if self._split_re else [text]
        for k, part in enumerate(parts):
            if k % 2:
                yield part, True
            elif part:
                yield part, False

    def _encode_plain(self, text: str) -> list[int]:
        if self._space_bytes is None or _SP_SPACE not in text:
            return self._sp.encode(text)
        ids: list[int] = []
        for k, part in enumerate(text.split(_SP_SPACE)):
            if k:
                ids.extend(self._space_bytes)
            if part:
                ids.extend(self._sp.encode(part))
        return ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`; add_special_tokens adds bos (and eos) as tokenizer_config.json says."""
        ids: list[int] = []
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        for segment, is_added in self._segments(text):
            if is_added:
                ids.append(self._added[segment])
            else:
                ids.extend(self._encode_plain(segment))
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def _is_plain_piece(self, i: int) -> bool:
        sp = self._sp
        return 0 <= i < self._sp_size and i not in self._literal and not (sp.is_byte(i) or sp.is_unused(i))

    def continuation_text(self, token_id: int) -> str | None:
        """The text `token_id` adds when it follows another plain SentencePiece piece, or None where that depends
        on its neighbours (special and byte-fallback ids, a piece at the start of a decode losing its space).

        It lets the streaming detokenizer append a step's text without decoding a window: decode(run + [id]) ==
        decode(run) + continuation_text(id) for any run ending in a plain piece. Checked once per id against
        SentencePiece itself, so a model whose normalizer rewrites pieces falls back to decoding."""
        text = self._continuations.get(token_id, False)
        if text is not False:
            return text
        text = None
        ref = self._reference_piece
        if ref is not None and self._is_plain_piece(token_id):
            candidate = self._sp.id_to_piece(token_id).replace(_SP_SPACE, " ")
            if self._sp.decode([ref, token_id]) == self._sp.decode([ref]) + candidate:
                text = candidate
        self._continuations[token_id] = text
        return text

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`; incomplete UTF-8 from byte-fallback pieces decodes to U+FFFD."""
        out: list[str] = []
        run: list[int] = []
        for raw in ids:
            i = int(raw)
            if i in self._literal:
                if run:
                    out.append(self._sp.decode(run))
                    run = []
                if not (skip_special_tokens and i in self.all_special_ids):
                    out.append(self._literal[i])
            elif 0 <= i < self._sp_size:
                run.append(i)
            else:
                raise ValueError(f"token id {i} is out of range for this tokenizer (size {self._size})")
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)

    # ---- chat -------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            chat_template: str | None = None, **chat_template_kwargs: Any) -> str | list[int]:
        """Render the model's own template (or `chat_template`: text or a configured name).

        chat_template_kwargs (e.g. enable_thinking) become template variables. The rendered text already
        carries whatever begin-of-sentence token the template wants, so tokenize=True adds none.
        """
        template = select_template(self.config.get("chat_template"), chat_template)
        special: dict[str, Any] = dict(self.special_tokens)
        special["additional_special_tokens"] = self.additional_special_tokens
        text = render_chat_template(template, messages, tools, add_generation_prompt, special,
                                    **chat_template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text
