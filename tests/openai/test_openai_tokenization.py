"""vLLM's /tokenize, /detokenize and /tokenizer_info on the shim: the ids generation would see (the ernie_tokenizer
stage's own rules: BOS on a text prompt, the chat template's rendering), vLLM's shapes, and clear errors."""
from __future__ import annotations

import httpx
import pytest

from ernie_client.openai import ServerConfig, create_app
from ernie_client.openai.triton import TritonBackend
from ernie_serve.serving.preprocess import Preprocessor
from ernie_serve.serving.request import parse_request
from ernie_serve.tokenizer import ErnieTokenizer

from openai_fake_triton import FakeTritonClient

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def served(start_shim, tiny_model_dir):
    """served(**ServerConfig fields) -> (base url, the model's tokenizer)."""
    def make(**cfg):
        config = ServerConfig(triton_url="fake:8001", **{"tokenizer": str(tiny_model_dir), "max_model_len": 512,
                                                          **cfg})
        fake = FakeTritonClient()
        app = create_app(config, TritonBackend(config.triton_url, config.model_name, client_factory=lambda _: fake))
        return start_shim(app).url, ErnieTokenizer.from_pretrained(tiny_model_dir)
    return make


def _preprocessed(tokenizer, fields: dict) -> list[int]:
    """The prompt ids the ernie_tokenizer stage makes of the same request."""
    import json

    import numpy as np

    inputs = {k: np.array([[json.dumps(v).encode() if not isinstance(v, str) else v.encode()]], dtype=object)
              for k, v in fields.items()}
    return Preprocessor(tokenizer, 512).encode(parse_request(inputs))[0]


def test_tokenize_gives_the_ids_generation_sees_for_a_prompt_and_a_chat(served):
    url, tok = served()
    r = httpx.post(f"{url}/tokenize", json={"model": "ernie", "prompt": "Hello there, world"}).json()
    assert r["tokens"] == _preprocessed(tok, {"text_input": "Hello there, world"})
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    bare = httpx.post(f"{url}/tokenize", json={"prompt": "Hello there, world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode("Hello there, world") and "token_strs" not in bare
    chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    assert chat["tokens"] == _preprocessed(tok, {"messages": CHAT})
    assert chat["token_strs"] == [tok.id_to_token(i) for i in chat["tokens"]]
    thinking_off = httpx.post(f"{url}/tokenize", json={"messages": CHAT,
                                                       "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert thinking_off["tokens"] == _preprocessed(tok, {"messages": CHAT,
                                                         "chat_template_kwargs": {"enable_thinking": False}})


def test_detokenize_inverts_tokenize_and_refuses_ids_outside_the_vocabulary(served):
    url, tok = served()
    text = "The weather in Paris is mild."
    ids = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [1, tok.vocab_size + 5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_tokenizer_info_names_the_special_tokens_and_the_length_limit(served):
    url, tok = served()
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["bos_token_id"] == tok.bos_token_id
    assert info["model_max_length"] == 512 and info["vocab_size"] == tok.vocab_size and info["tokenizer_class"]


def test_bad_requests_get_a_400_an_unknown_model_a_404_and_no_tokenizer_a_501(served, start_shim):
    url, _ = served(api_key="k")
    auth = {"Authorization": "Bearer k"}
    assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.post(f"{url}/tokenize", json={"prompt": "x", "model": "other"}, headers=auth).status_code == 404
    both = httpx.post(f"{url}/tokenize", json={"prompt": "x", "messages": CHAT}, headers=auth)
    assert both.status_code == 400
    assert httpx.post(f"{url}/tokenize", json={"messages": []}, headers=auth).status_code == 400
    config = ServerConfig(triton_url="fake:8001")
    fake = FakeTritonClient()
    bare = start_shim(create_app(config, TritonBackend(config.triton_url, config.model_name,
                                                       client_factory=lambda _: fake))).url
    r = httpx.post(f"{bare}/tokenize", json={"prompt": "x"})
    assert r.status_code == 501 and "--tokenizer" in r.json()["error"]["message"]


def test_ernie_serve_hands_the_shim_the_served_models_tokenizer_length_and_template(tmp_path):
    from ernie_serve.serving.launcher import TritonServer

    server = TritonServer({"model": str(tmp_path), "max_model_len": "512", "chat_template": "plain"},
                          openai_port=1, run_dir=tmp_path / "run")
    assert server._shim_tokenizer_args() == ["--tokenizer", str(tmp_path), "--max-model-len", "512",
                                             "--chat-template", "plain"]
    server = TritonServer({"model": str(tmp_path), "tokenizer": str(tmp_path / "tok")}, openai_port=1,
                          run_dir=tmp_path / "run2")
    assert server._shim_tokenizer_args()[:4] == ["--tokenizer", str(tmp_path / "tok"), "--max-model-len", "2048"]


def test_a_token_id_prompt_is_echoed_as_the_served_tokenizers_text(served):
    """lm-eval's loglikelihood requests send token ids with echo: the shim's tokenizer shows them as text."""
    url, tok = served()
    ids = tok.encode("The weather in Paris is mild.", add_special_tokens=False)
    r = httpx.post(f"{url}/v1/completions", json={"model": "ernie", "prompt": [ids], "max_tokens": 2, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode(ids) + " w0 w7"
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": [5, tok.vocab_size], "max_tokens": 1, "echo": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
