"""Fit the embedded tiny model to the demo chat set, so that it speaks ERNIE-4.5's Thinking format.

Random weights print noise, so nothing would show whether reasoning and tool-call parsing work
through the whole stack. `data/chat_demo.jsonl` holds a handful of conversations; each one is
rendered with the model's own chat template (the exact prompt serving produces) and followed by
the answer written the way ERNIE-4.5-21B-A3B-Thinking writes it:

    thinking:      {reasoning}\\n</think>\\n\\n<response>\\n{response}\\n</response><|im_end|>
    tool call:     {reasoning}\\n</think>\\n\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>
    no thinking:   <response>\\n{response}\\n</response><|im_end|>   (prompt ends in "<think>\\n\\n</think>\\n\\n")

The model is the project's own ErnieForCausalLM, run on the no-cache prefill path (every sequence
fresh, context_len == query_len), which is differentiable end to end. The loss covers the answer
tokens only. Full-batch Adam from a fixed initialization has no randomness left, so the fit is a
pure function of the dataset and the init; see `fit_model` for how the step count is chosen.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from tqdm.auto import tqdm

from ..model.attention import AttentionMetadata
from ..model.ernie import ErnieForCausalLM
from ..model.checkpoint_map import map_mtp_tensor_name, map_tensor_name
from ..model.loader import load_model, load_mtp
from .dataset import dataset_digest, dataset_path  # noqa: F401  (this module's names too)

IM_END = "<|im_end|>"
MAX_STEPS = 400
LEARNING_RATE = 3e-3
# Stop once every answer token wins its teacher-forced argmax by this many logits: greedy decoding
# then reproduces each answer, with room for the cached/batched serving kernels' rounding differences.
TARGET_MARGIN = 4.0
_MARGIN_CHECK_LOSS = 0.05  # below this mean loss, start checking the margins (a numpy pass over the logits)


@dataclass
class ChatExample:
    """One conversation and the answer the model is fitted to give."""

    name: str
    messages: list[dict]
    reasoning: str = ""
    response: str | None = None
    tool_calls: list[dict] = field(default_factory=list)  # [{"name": ..., "arguments": {...}}]
    tools: list[dict] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def thinking(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False

    def completion(self) -> str:
        """The generated text (before the end-of-turn token), in ERNIE-4.5 Thinking's layout."""
        if self.tool_calls:
            blocks = [f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in self.tool_calls]
            answer = "\n".join(blocks)
        else:
            answer = f"<response>\n{self.response}\n</response>"
        return f"{self.reasoning}\n</think>\n\n{answer}" if self.thinking else answer


def load_examples(path: Path | None = None) -> list[ChatExample]:
    examples = []
    for n, line in enumerate(Path(path or dataset_path()).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        ex = ChatExample(**json.loads(line))
        if (ex.response is None) == (not ex.tool_calls):
            raise ValueError(f"{path or dataset_path()}:{n} ({ex.name}): give exactly one of response and tool_calls")
        if ex.thinking != bool(ex.reasoning):
            raise ValueError(f"{path or dataset_path()}:{n} ({ex.name}): reasoning is required with thinking "
                             f"and must be empty with enable_thinking=false")
        examples.append(ex)
    return examples


def encode_example(tokenizer, ex: ChatExample) -> tuple[list[int], list[int]]:
    """(prompt ids exactly as serving renders them, answer ids ending with <|im_end|>)."""
    prompt = tokenizer.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                           tokenize=False, **ex.chat_template_kwargs)
    im_end = tokenizer.token_to_id(IM_END)
    if im_end is None:
        raise ValueError(f"the tokenizer has no {IM_END} token; the demo tokenizer must be built by tokenizer_builder")
    return tokenizer.encode(prompt), tokenizer.encode(ex.completion()) + [im_end]


@dataclass
class Batch:
    """All examples as one flattened step of fresh sequences, and the rows the loss is taken on."""

    input_ids: paddle.Tensor  # [T]
    positions: paddle.Tensor  # [T]
    meta: AttentionMetadata
    loss_rows: paddle.Tensor  # [N] rows of the hidden states that predict an answer token
    labels: paddle.Tensor  # [N]


def make_batch(encoded: list[tuple[list[int], list[int]]]) -> Batch:
    ids, pos, rows, labels, lens = [], [], [], [], []
    for prompt, answer in encoded:
        seq = prompt + answer
        start = len(ids)
        ids += seq[:-1]  # the last token is only ever a target
        pos += range(len(seq) - 1)
        lens.append(len(seq) - 1)
        rows += range(start + len(prompt) - 1, start + len(seq) - 1)
        labels += answer
    meta = AttentionMetadata.build(query_lens=lens, context_lens=lens, block_tables=None, block_size=16,
                                   slot_mapping=None, max_position=max(lens))
    as_tensor = lambda v: paddle.to_tensor(np.asarray(v, dtype=np.int64))  # noqa: E731
    return Batch(as_tensor(ids), as_tensor(pos), meta, as_tensor(rows), as_tensor(labels))


def answer_logits(model: ErnieForCausalLM, batch: Batch) -> paddle.Tensor:
    hidden = model(batch.input_ids, batch.positions, batch.meta, None)
    return model.compute_logits(paddle.index_select(hidden, batch.loss_rows))


def min_margin(logits: paddle.Tensor, labels: paddle.Tensor) -> float:
    """Smallest (target logit - best other logit) over the answer tokens; > 0 means greedy reproduces."""
    lg = logits.numpy()
    lab = labels.numpy()
    target = lg[np.arange(len(lab)), lab]
    lg[np.arange(len(lab)), lab] = -np.inf
    return float((target - lg.max(axis=-1)).min())


@dataclass
class FitResult:
    losses: list[float]  # one per forward pass; the last is the loss of the returned weights
    margin: float  # min_margin of the returned weights
    steps: int  # optimizer updates made
    seconds: float
    mtp: "FitResult | None" = None  # the MTP head's fit, when the checkpoint has one


def trainable_parameters(model: ErnieForCausalLM) -> list[paddle.Tensor]:
    """Everything but the router correction bias, which only picks experts and so gets no gradient."""
    params = []
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            continue
        p.stop_gradient = False
        params.append(p)
    return params


def fit_model(model: ErnieForCausalLM, batch: Batch, max_steps: int = MAX_STEPS, lr: float = LEARNING_RATE,
              target_margin: float | None = TARGET_MARGIN, seed: int = 0, show_progress: bool = True) -> FitResult:
    """Full-batch Adam on the answer tokens, in place.

    Runs at most `max_steps` updates, and stops before one once every answer token's margin reaches
    `target_margin` (None: always run max_steps). The stopping test reads the same deterministic
    numbers as the updates, so it adds no dependence on anything but the data and the init.
    """
    paddle.seed(seed)
    return _adam(trainable_parameters(model), lambda: answer_logits(model, batch), batch.labels, max_steps, lr,
                 target_margin, "Fitting tiny model", show_progress)


def _adam(params: list[paddle.Tensor], logits_fn, labels: paddle.Tensor, max_steps: int, lr: float,
          target_margin: float | None, desc: str, show_progress: bool) -> FitResult:
    """The fitting loop both fits share: cross-entropy of logits_fn() against labels, stop on the margin."""
    for p in params:
        p.stop_gradient = False
    opt = paddle.optimizer.Adam(learning_rate=lr, parameters=params,
                                grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    losses: list[float] = []  # losses[i]: before update i; the last one is the returned weights' loss
    margin = float("-inf")
    t0 = time.perf_counter()
    bar = tqdm(total=max_steps, desc=desc, unit="step", disable=not show_progress)
    try:
        for step in range(max_steps + 1):
            logits = logits_fn()
            loss = F.cross_entropy(logits, labels)
            losses.append(float(loss))
            if (target_margin is not None and losses[-1] < _MARGIN_CHECK_LOSS) or step == max_steps:
                margin = min_margin(logits.detach(), labels)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", margin=f"{margin:.2f}")
            if step == max_steps or (target_margin is not None and margin >= target_margin):
                break
            loss.backward()
            opt.step()
            opt.clear_grad()
            bar.update(1)
    finally:
        bar.close()
        for p in params:
            p.stop_gradient = True
            p.clear_gradient()
    return FitResult(losses, margin, len(losses) - 1, time.perf_counter() - t0)


@dataclass
class MTPBatch:
    """The MTP head's training step over the same examples: at position t it reads x_{t+1} and the frozen
    target's h_t, and is scored on predicting x_{t+2} where that is an answer token."""

    next_ids: paddle.Tensor  # [T'] x_{t+1}
    hidden_rows: paddle.Tensor  # [T'] rows t of the target's hidden states (Batch layout)
    positions: paddle.Tensor
    meta: AttentionMetadata
    loss_rows: paddle.Tensor
    labels: paddle.Tensor


def make_mtp_batch(encoded: list[tuple[list[int], list[int]]]) -> MTPBatch:
    ids, rows, pos, loss_rows, labels, lens = [], [], [], [], [], []
    start = 0  # this sequence's first row in the target's Batch
    for prompt, answer in encoded:
        seq = prompt + answer
        m = len(seq) - 2  # positions t = 0 .. len-3 have both x_{t+1} and a target x_{t+2}
        base = len(ids)
        ids += seq[1 : m + 1]
        rows += range(start, start + m)
        pos += range(m)
        loss_rows += [base + t for t in range(m) if t + 2 >= len(prompt)]
        labels += [seq[t + 2] for t in range(m) if t + 2 >= len(prompt)]
        lens.append(m)
        start += len(seq) - 1
    meta = AttentionMetadata.build(query_lens=lens, context_lens=lens, block_tables=None, block_size=16,
                                   slot_mapping=None, max_position=max(lens))
    as_tensor = lambda v: paddle.to_tensor(np.asarray(v, dtype=np.int64))  # noqa: E731
    return MTPBatch(as_tensor(ids), as_tensor(rows), as_tensor(pos), meta, as_tensor(loss_rows), as_tensor(labels))


MTP_MAX_STEPS = 300
MTP_TARGET_MARGIN = 1.0  # the head's greedy draft equals the answer's token two ahead, with some room


def fit_mtp(model: ErnieForCausalLM, mtp, batch: Batch, mtp_batch: MTPBatch, max_steps: int = MTP_MAX_STEPS,
            lr: float = LEARNING_RATE, target_margin: float | None = MTP_TARGET_MARGIN,
            show_progress: bool = True) -> FitResult:
    """Adam on the MTP head alone, the fitted target frozen (its hidden states computed once), in place."""
    with paddle.no_grad():
        hidden = paddle.index_select(model(batch.input_ids, batch.positions, batch.meta, None), mtp_batch.hidden_rows)

    def logits():
        out = mtp(model, mtp_batch.next_ids, hidden, mtp_batch.positions, mtp_batch.meta, None)
        return model.compute_logits(paddle.index_select(out, mtp_batch.loss_rows))

    return _adam(list(mtp.parameters()), logits, mtp_batch.labels, max_steps, lr, target_margin,
                 "Fitting tiny MTP head", show_progress)


def export_pt_tensors(model: ErnieForCausalLM, names: list[str], mtp=None) -> dict[str, np.ndarray]:
    """The model's parameters (and the MTP head's, for model.mtp_* names) back as the "-PT" tensors `names`,
    inverting the loader's own mapping."""
    params = {n: p.numpy() for n, p in model.named_parameters()}
    head = {n: p.numpy() for n, p in mtp.named_parameters()} if mtp is not None else {}
    out = {}
    for name in names:
        is_mtp = map_tensor_name(name, model.config) == "mtp"
        piece = map_mtp_tensor_name(name, model.config) if is_mtp else map_tensor_name(name, model.config)
        if not hasattr(piece, "param") or (is_mtp and mtp is None):
            raise ValueError(f"cannot export {name!r}: the loader maps it to {piece!r}")
        source = head if is_mtp else params
        arr = source[piece.param][piece.index] if piece.index else source[piece.param]
        out[name] = np.ascontiguousarray(arr.T if piece.transpose else arr, dtype=np.float32)
    return out


def weights_digest(tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name]).tobytes())
    return h.hexdigest()


def fit_checkpoint(model_dir: Path, max_steps: int = MAX_STEPS, target_margin: float | None = TARGET_MARGIN,
                   examples: list[ChatExample] | None = None, show_progress: bool = True,
                   mtp_max_steps: int = MTP_MAX_STEPS) -> tuple[dict[str, np.ndarray], FitResult]:
    """Load the (randomly initialized) checkpoint in model_dir, fit it (then its MTP head, if it has one, with
    the fitted body frozen), return its "-PT" tensors. target_margin None: run every step of both fits."""
    from ..tokenizer import ErnieTokenizer

    model_dir = Path(model_dir)
    tokenizer = ErnieTokenizer.from_pretrained(model_dir)
    encoded = [encode_example(tokenizer, ex) for ex in (examples or load_examples())]
    batch = make_batch(encoded)
    model = load_model(model_dir, show_progress=False)
    mtp = load_mtp(model.config, model.mtp_weights, str(model_dir)) if model.mtp_weights else None
    result = fit_model(model, batch, max_steps=max_steps, target_margin=target_margin, show_progress=show_progress)
    if mtp is not None:
        result.mtp = fit_mtp(model, mtp, batch, make_mtp_batch(encoded), max_steps=mtp_max_steps,
                             target_margin=None if target_margin is None else MTP_TARGET_MARGIN,
                             show_progress=show_progress)
    names = list(json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"])
    return export_pt_tensors(model, names, mtp), result
