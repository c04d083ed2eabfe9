"""End-to-end: the seeds' first command as written (`ernie-serve --model baidu/ERNIE-4.5-21B-A3B-Thinking ...`),
its id resolved from a Hugging Face cache laid out as the hub writes it (holding the embedded tiny checkpoint)
with HF_HUB_OFFLINE=1, serves a chat through its --port. One server, started as a user starts it: the
`ernie-serve` command in a process of its own."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from e2e_helpers import wait_for_banner, wait_for_health
from hf_hub_cache import add_model

pytestmark = pytest.mark.e2e
THINKING = "baidu/ERNIE-4.5-21B-A3B-Thinking"
# the seed's flags for the 21B Thinking model, but --port (0, a port of its own, for 8180)
SEED_FLAGS = ["--tensor-parallel-size", "1", "--max-model-len", "131072", "--quantization", "wint8",
              "--reasoning-parser", "ernie-x1", "--tool-call-parser", "ernie-x1", "--max-num-seqs", "32"]


def test_the_seeds_model_id_serves_a_chat_from_an_offline_hugging_face_cache(tmp_path, tiny_model_dir):
    snapshot = add_model(tmp_path / "hf", THINKING, tiny_model_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "FD_", "ERNIE_API"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    log = open(tmp_path / "ernie-serve.log", "w+")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "ernie-serve"), "--model", THINKING, *SEED_FLAGS,
                             "--port", "0", "--run-dir", str(tmp_path / "run")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{wait_for_banner(tmp_path / 'ernie-serve.log', 400, proc)['openai']}"
        wait_for_health(url, 400, proc)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "ernie", "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["content"] or message.get("reasoning_content"), message
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert f"--model {THINKING}: {snapshot}" in output, output[-3000:]
    assert code == 0, output[-3000:]
