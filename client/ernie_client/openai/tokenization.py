"""vLLM's tokenizer endpoints on the shim: /tokenize, /detokenize, /tokenizer_info.

Evaluation harnesses count and split prompts with the server's own tokenizer (lm-evaluation-harness's
`tokenizer_backend=remote`), and clients check a prompt's length before sending it. The shim holds the served
model's tokenizer (`--tokenizer`, which ernie-serve passes) and renders chats with the same template and the same
ernie_serve.chat function as the ernie_tokenizer stage, so /tokenize gives exactly the ids generation would see:
a text prompt with the BOS the Triton front adds, a chat as the template writes it. Request and response shapes are
vLLM's.
"""
from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from ernie_serve.chat import render_chat_prompt  # the ernie_tokenizer stage's own rendering

from .errors import OpenAIError


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the BOS the Triton front adds to a text prompt
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes its own
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class Tokenization:
    """The served model's tokenizer and what /tokenize needs besides it."""

    def __init__(self, tokenizer_dir: str, max_model_len: int | None, chat_template: str | None = None):
        from ernie_serve.tokenizer import ErnieTokenizer  # sentencepiece + jinja only: no Paddle in the shim

        self.tokenizer = ErnieTokenizer.from_pretrained(tokenizer_dir)
        self.max_model_len = max_model_len
        self.chat_template = chat_template

    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        tok = self.tokenizer
        if isinstance(req, TokenizeChatRequest):
            try:
                text, ids = render_chat_prompt(tok, req.messages, req.tools, req.chat_template_kwargs,
                                               self.chat_template, req.add_generation_prompt)
            except Exception as e:  # noqa: BLE001 - a template error is the request's fault
                raise OpenAIError(400, f"the chat template could not render the messages: {e}",
                                  param="messages") from None
            if req.add_special_tokens:  # the template writes its own; asked for, the tokenizer's go in too
                ids = tok.encode(text, add_special_tokens=True)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.id_to_token(i) for i in ids]
        return out

    def detokenize(self, req: DetokenizeRequest) -> dict[str, str]:
        return {"prompt": self._decode(req.tokens, "tokens")}

    def decode_prompt(self, token_ids: list[int]) -> str:
        """A token-id prompt as the text a completion's echo shows."""
        return self._decode(token_ids, "prompt")

    def _decode(self, token_ids: list[int], param: str) -> str:
        vocab = self.tokenizer.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"{param}: token ids must be in [0, {vocab}) (the tokenizer's vocabulary), got "
                              f"{bad[:5]}", param=param)
        return self.tokenizer.decode(token_ids)

    def info(self) -> dict[str, Any]:
        tok = self.tokenizer
        info = {k: v for k, v in tok.config.items() if isinstance(v, (str, int, float, bool)) or v is None}
        info.update(tokenizer_class=tok.config.get("tokenizer_class") or type(tok).__name__,
                    bos_token=tok.bos_token, eos_token=tok.eos_token, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, vocab_size=tok.vocab_size,
                    model_max_length=self.max_model_len)
        if self.chat_template:
            info["chat_template"] = self.chat_template
        return info


def tokenization_router(tokenization: Tokenization | None, check_auth: Callable,
                        check_model: Callable[[str | None], None]) -> APIRouter:
    """The three endpoints; without a tokenizer each answers 501 saying how to give the shim one."""
    router = APIRouter(dependencies=[Depends(check_auth)])

    def ready() -> Tokenization:
        if tokenization is None:
            raise OpenAIError(501, "this shim has no tokenizer: start ernie-openai with --tokenizer DIR (the "
                                   "served model's directory; ernie-serve passes it)", code="not_implemented")
        return tokenization

    @router.post("/tokenize")
    async def tokenize(req: TokenizeChatRequest | TokenizeCompletionRequest):
        check_model(req.model)
        return ready().tokenize(req)

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        return ready().detokenize(req)

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        return ready().info()

    return router
