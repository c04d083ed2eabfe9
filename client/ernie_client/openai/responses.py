"""OpenAI response, chunk and usage objects built from choice states (plain dicts: what goes on the wire)."""
from __future__ import annotations

import json
import math

from .generation import ChoiceState
from .triton import TokenLogprob


def usage(states: list[ChoiceState]) -> dict:
    prompt = sum(s.num_input_tokens or 0 for s in states if s.counts_prompt)
    completion = sum(s.completion_tokens for s in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens or 0 for s in states if s.counts_prompt)},
        "completion_tokens_details": {"reasoning_tokens": sum(s.reasoning_tokens for s in states)},
    }


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number.
    return x if math.isfinite(x) else -9999.0


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob], k: int) -> dict:
    def top(e: TokenLogprob) -> list[dict]:
        raw = e.top_bytes + [None] * (len(e.top) - len(e.top_bytes))
        return [{"token": t, "logprob": _finite(lp), "bytes": b if b is not None else _bytes(t)}
                for (_, t, lp), b in zip(e.top[:k], raw)]

    return {"content": [{"token": e.token, "logprob": _finite(e.logprob),
                         "bytes": e.bytes if e.bytes is not None else _bytes(e.token), "top_logprobs": top(e)}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], k: int, offset: int = 0) -> dict:
    """OpenAI's legacy shape; with echo the prompt's tokens come first, the first with null figures."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(e.token)
        offset += len(e.token)
    return {"tokens": tokens,
            "token_logprobs": [None if e.logprob is None else _finite(e.logprob) for e in entries],
            "top_logprobs": [None if e.logprob is None else {t: _finite(lp) for _, t, lp in e.top[:k]}
                             for e in entries],
            "text_offset": offsets}


def prompt_logprobs(entries: list[TokenLogprob] | None, k: int | None) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: null for the first prompt token, then {token_id: {logprob, rank, decoded_token}}
    with the prompt token and its k most likely alternatives."""
    if k is None or entries is None:
        return None
    out: list[dict | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": _finite(e.logprob), "rank": e.rank, "decoded_token": e.token}}
        for rank, (tid, tok, lp) in enumerate(e.top[:k], 1):
            d.setdefault(str(tid), {"logprob": _finite(lp), "rank": rank, "decoded_token": tok})
        out.append(d)
    return out


def chat_message(s: ChoiceState) -> dict:
    text = "".join(s.text)
    calls = s.full_tool_calls()
    msg = {"role": "assistant", "content": text if (text or not calls) else None,
           "reasoning_content": "".join(s.reasoning) or None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_completion(rid: str, created: int, model: str, states: list[ChoiceState], num_logprobs: int | None,
                    return_token_ids: bool, num_prompt_logprobs: int | None = None) -> dict:
    choices = []
    for s in states:
        c = {"index": s.index, "message": chat_message(s),
             "logprobs": chat_logprobs(s.logprobs, num_logprobs) if num_logprobs is not None else None,
             "finish_reason": s.finish_reason}
        if return_token_ids:
            c["message"]["prompt_token_ids"] = s.prompt_token_ids
            c["message"]["completion_token_ids"] = s.token_ids
        choices.append(c)
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(states)}
    if num_prompt_logprobs is not None:  # vLLM's place for a chat: the response's, the choices share the prompt
        body["prompt_logprobs"] = prompt_logprobs(states[0].prompt_logprobs, num_prompt_logprobs)
    return body


def completion(rid: str, created: int, model: str, states: list[ChoiceState], echo_prompts: dict[int, str],
               num_logprobs: int | None, return_token_ids: bool, num_prompt_logprobs: int | None = None) -> dict:
    """`echo_prompts`: each echoed choice's prompt text; with logprobs their entries start with the prompt's."""
    choices = []
    for s in states:
        prefix = echo_prompts.get(s.index, "")
        # A completion is raw text: the shim asks for skip_parsers; an ensemble without that input may
        # still have split it into reasoning and content, so join them back (a no-op otherwise).
        text = "".join(r + t for r, t in zip(s.reasoning, s.text))
        entries, offset = s.logprobs, len(prefix)
        if s.index in echo_prompts and s.prompt_logprobs is not None:
            entries, offset = s.prompt_logprobs + s.logprobs, 0
        c = {"index": s.index, "text": prefix + text,
             "logprobs": completion_logprobs(entries, num_logprobs, offset) if num_logprobs is not None else None,
             "finish_reason": s.finish_reason}
        if num_prompt_logprobs is not None:
            c["prompt_logprobs"] = prompt_logprobs(s.prompt_logprobs, num_prompt_logprobs)
        if return_token_ids:
            c["prompt_token_ids"] = s.prompt_token_ids
            c["completion_token_ids"] = s.token_ids
        choices.append(c)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(states)}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
