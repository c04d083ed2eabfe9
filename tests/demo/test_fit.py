"""The demo fit: its dataset, the answer layout it trains, and that it is deterministic."""
from __future__ import annotations

import json
import shutil

import pytest

from ernie_serve.demo import fit
from ernie_serve.demo.tiny_model import BUILD_VERSION, CONFIGS, random_weights, _write_weights
from ernie_serve.tokenizer import ErnieTokenizer


def test_completion_layouts_follow_ernie_thinking_format():
    answer = fit.ChatExample("a", [{"role": "user", "content": "q"}], reasoning="think", response="hi")
    assert answer.completion() == "think\n</think>\n\n<response>\nhi\n</response>"
    call = fit.ChatExample("c", [], reasoning="r", tool_calls=[{"name": "f", "arguments": {"x": 1}}])
    assert call.completion() == 'r\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    plain = fit.ChatExample("p", [], response="hi", chat_template_kwargs={"enable_thinking": False})
    assert plain.completion() == "<response>\nhi\n</response>"


def test_dataset_covers_reasoning_tools_tool_results_and_no_thinking():
    examples = fit.load_examples()
    assert 8 <= len(examples) <= 16
    assert len({ex.name for ex in examples}) == len(examples)
    assert sum(1 for ex in examples if ex.response is not None and ex.thinking) >= 4
    assert sum(1 for ex in examples if ex.tool_calls) >= 3
    assert any(ex.messages[-1]["role"] == "tool" for ex in examples)
    assert any(not ex.thinking for ex in examples)


def test_dataset_rejects_an_example_with_both_response_and_tool_calls(tmp_path):
    bad = {"name": "x", "messages": [{"role": "user", "content": "q"}], "reasoning": "r", "response": "a",
           "tool_calls": [{"name": "f", "arguments": {}}]}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="exactly one of response and tool_calls"):
        fit.load_examples(path)


def test_prompts_are_the_served_template_and_answers_end_with_im_end(tiny_model_dir):
    tok = ErnieTokenizer.from_pretrained(tiny_model_dir)
    for ex in fit.load_examples():
        prompt, answer = fit.encode_example(tok, ex)
        text = tok.decode(prompt, skip_special_tokens=False)
        assert text.endswith("<think>\n" if ex.thinking else "<think>\n\n</think>\n\n"), ex.name
        assert answer[-1] == tok.token_to_id("<|im_end|>")
        assert tok.decode(answer[:-1], skip_special_tokens=False) == ex.completion()


def test_built_model_records_its_fit(tiny_model_dir):
    stamp = json.loads((tiny_model_dir / "BUILD").read_text())
    assert stamp["version"] == BUILD_VERSION and stamp["data"] == fit.dataset_digest()
    record = json.loads((tiny_model_dir / "FIT.json").read_text())
    assert record["min_margin"] >= fit.TARGET_MARGIN and record["final_loss"] < 0.05


def test_fit_is_deterministic(tiny_model_dir, tmp_path):
    """Same data and init -> bitwise the same weights and losses (a few steps on a few examples)."""
    init = tmp_path / "init"
    init.mkdir()
    for f in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_model_dir / f, init / f)
    _write_weights(init, "tiny", "pt", random_weights(CONFIGS["tiny"], seed=0))
    examples = [ex for ex in fit.load_examples() if not ex.tools][:4]
    runs = [fit.fit_checkpoint(init, max_steps=4, target_margin=None, examples=examples, show_progress=False)
            for _ in range(2)]
    (w1, r1), (w2, r2) = runs
    assert r1.losses == r2.losses and r1.steps == r2.steps == 4
    assert r1.losses[-1] < r1.losses[0]
    assert fit.weights_digest(w1) == fit.weights_digest(w2)
    assert set(w1) == set(random_weights(CONFIGS["tiny"], seed=0))


def test_export_inverts_the_loader(tiny_model_dir, tmp_path):
    from ernie_serve.model.loader import load_model

    weights = random_weights(CONFIGS["tiny"], seed=0)
    shutil.copy(tiny_model_dir / "tokenizer.model", tmp_path / "tokenizer.model")
    shutil.copy(tiny_model_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    _write_weights(tmp_path, "tiny", "pt", weights)
    exported = fit.export_pt_tensors(load_model(tmp_path, show_progress=False), list(weights))
    assert fit.weights_digest(exported) == fit.weights_digest(weights)
