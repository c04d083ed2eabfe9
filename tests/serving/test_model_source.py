"""--model as FastDeploy takes it (ernie_serve/model_source.py): local directories, model ids through
FD_MODEL_SOURCE, and the one message a failure gives. No network: ids resolve from a Hugging Face cache laid out
as the hub writes it, with HF_HUB_OFFLINE=1 (huggingface_hub reads its environment at import, hence the
subprocesses)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ernie_serve import model_source
from ernie_serve.model_source import ModelNotFoundError, resolve_model

from hf_hub_cache import add_model

THINKING = "baidu/ERNIE-4.5-21B-A3B-Thinking"
ROOT = Path(__file__).resolve().parents[2]


def _offline_env(hf_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "FD_", "ERNIE_API"))}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", **extra}


def _python(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_a_model_id_resolves_to_its_snapshot_in_the_hugging_face_cache_offline(tmp_path, tiny_model_dir):
    snapshot = add_model(tmp_path, THINKING, tiny_model_dir)
    run = _python(f"from ernie_serve.model_source import resolve_model; print(resolve_model({THINKING!r}))",
                  _offline_env(tmp_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == str(snapshot)


def test_a_model_id_downloads_through_an_hf_endpoint_mirror_into_the_shared_cache_with_a_progress_bar(
        tmp_path, tiny_model_dir):
    from hf_hub_cache import serve_mirror

    mirror = serve_mirror({THINKING: tiny_model_dir})
    try:
        endpoint = f"http://127.0.0.1:{mirror.server_address[1]}"
        env = {**_offline_env(tmp_path), "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0"}
        run = _python(f"from ernie_serve.model_source import resolve_model; print(resolve_model({THINKING!r}))", env)
        assert run.returncode == 0, run.stderr[-2000:]
        snapshot = Path(run.stdout.strip().splitlines()[-1])
        assert snapshot.parent.parent == tmp_path / "hub" / "models--baidu--ERNIE-4.5-21B-A3B-Thinking"
        assert (snapshot / "tokenizer.model").read_bytes() == (tiny_model_dir / "tokenizer.model").read_bytes()
        assert "Fetching" in run.stderr  # huggingface_hub's progress bar
        missing = _python("from ernie_serve.model_source import resolve_model; resolve_model('baidu/No-Such-Model')",
                          env)
        assert f"could not fetch baidu/No-Such-Model (tried the Hugging Face cache {tmp_path}/hub, then {endpoint})" \
            in missing.stderr, missing.stderr[-2000:]
    finally:
        mirror.shutdown()
    # the download stays in the cache: offline, the same id resolves from it
    again = _python(f"from ernie_serve.model_source import resolve_model; print(resolve_model({THINKING!r}))",
                    _offline_env(tmp_path))
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == str(snapshot), again.stderr[-2000:]


def test_the_offline_api_takes_a_model_id_as_ernie_serve_does(tmp_path, tiny_model_dir):
    add_model(tmp_path, THINKING, tiny_model_dir)
    code = (f"from ernie_serve import LLM, SamplingParams\n"
            f"llm = LLM(model={THINKING!r}, max_model_len=256, num_gpu_blocks_override=32, disable_progress_bar=True)\n"
            f"out = llm.generate(['Hi'], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)\n"
            f"print('model', llm.config.model); print('tokens', len(out[0].outputs[0].token_ids))")
    run = _python(code, _offline_env(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"model {tmp_path}/hub/models--baidu--ERNIE-4.5-21B-A3B-Thinking/snapshots/" in run.stdout
    assert "tokens 3" in run.stdout


def test_ernie_serve_refuses_an_id_it_cannot_resolve_in_one_message_before_tritonserver_starts(tmp_path):
    run = subprocess.run([str(Path(sys.executable).parent / "ernie-serve"), "--model", "baidu/ERNIE-4.5-300B-A47B-Paddle",
                          "--port", "8180", "--run-dir", str(tmp_path / "run")],
                         env=_offline_env(tmp_path), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 2, run.stdout + run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("ernie-serve:")]
    assert len(errors) == 1, run.stderr
    assert "baidu/ERNIE-4.5-300B-A47B-Paddle" in errors[0] and "FD_MODEL_SOURCE=HUGGINGFACE" in errors[0]
    assert f"the Hugging Face cache {tmp_path}/hub only (HF_HUB_OFFLINE is set)" in errors[0]
    assert "starting tritonserver" not in run.stdout and not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", ["/no/such/ckpt", "./ckpt", "~/no-such-ckpt", "a/b/c", "tests/no-such-ckpt"])
def test_a_local_path_that_does_not_exist_is_said_to_be_missing_not_looked_up_as_an_id(model, monkeypatch):
    monkeypatch.chdir(ROOT)  # "tests/..." is a path because tests/ exists here
    monkeypatch.setattr(model_source, "FETCHERS", {s: _never for s in model_source.SOURCES})
    with pytest.raises(ModelNotFoundError, match=f"--model {model}: no such directory"):
        resolve_model(model)


def _never(model: str, flag: str) -> str:
    raise AssertionError(f"{model} was sent to a model hub")


def test_a_local_directory_is_taken_as_it_is(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(model_source, "FETCHERS", {s: _never for s in model_source.SOURCES})
    assert resolve_model(str(tiny_model_dir)) == str(tiny_model_dir)
    assert resolve_model(None) is None


@pytest.mark.parametrize("source, install", [("MODELSCOPE", "pip install modelscope"),
                                             ("AISTUDIO", "pip install aistudio-sdk")])
def test_a_source_whose_client_is_not_installed_is_refused_naming_it_and_what_to_install(source, install,
                                                                                        monkeypatch):
    module = {"MODELSCOPE": "modelscope", "AISTUDIO": "aistudio_sdk"}[source]
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed, whatever this environment holds
    monkeypatch.setenv("FD_MODEL_SOURCE", source.lower())
    with pytest.raises(ModelNotFoundError, match=f"FD_MODEL_SOURCE={source} needs its client.*{install}"):
        resolve_model(THINKING)


def test_modelscope_and_aistudio_get_fastdeploys_repo_id_and_download_directory(tmp_path, monkeypatch):
    """baidu/... is PaddlePaddle/... there, and FD_MODEL_CACHE/<repo id> is where it goes, as in FastDeploy."""
    import types

    calls = []

    def fake_download(repo_id, local_dir):
        calls.append((repo_id, local_dir))
        Path(local_dir).mkdir(parents=True)
        return local_dir

    for module in ("modelscope", "modelscope.hub", "modelscope.hub.snapshot_download", "aistudio_sdk",
                   "aistudio_sdk.snapshot_download"):
        monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(snapshot_download=fake_download))
    monkeypatch.setenv("FD_MODEL_CACHE", str(tmp_path))
    for source in ("MODELSCOPE", "AISTUDIO"):
        monkeypatch.setenv("FD_MODEL_SOURCE", source)
        got = resolve_model(f"baidu/ERNIE-4.5-0.3B-{source}")
        assert got == str(tmp_path / f"PaddlePaddle/ERNIE-4.5-0.3B-{source}")
    assert [c[0] for c in calls] == ["PaddlePaddle/ERNIE-4.5-0.3B-MODELSCOPE", "PaddlePaddle/ERNIE-4.5-0.3B-AISTUDIO"]


def test_an_unknown_fd_model_source_is_refused_naming_the_sources(monkeypatch):
    monkeypatch.setenv("FD_MODEL_SOURCE", "S3")
    with pytest.raises(ModelNotFoundError, match="FD_MODEL_SOURCE='S3' is not a model source: use one of "
                                                 "HUGGINGFACE, MODELSCOPE, AISTUDIO"):
        resolve_model(THINKING)


# ---------------------------------------------------------------- FD_API_KEY
def test_fd_api_key_is_read_as_the_api_key_after_ernie_api_key_and_the_flag(tmp_path, monkeypatch):
    from ernie_serve.cli.serve import server_from_args

    monkeypatch.delenv("ERNIE_API_KEY", raising=False)
    monkeypatch.setenv("FD_API_KEY", "fd-key")
    assert server_from_args(["--run-dir", str(tmp_path / "a")])[0].api_key == "fd-key"
    monkeypatch.setenv("ERNIE_API_KEY", "ernie-key")
    assert server_from_args(["--run-dir", str(tmp_path / "b")])[0].api_key == "ernie-key"
    assert server_from_args(["--run-dir", str(tmp_path / "c"), "--api-key", "flag-key"])[0].api_key == "flag-key"


def test_several_keys_in_fd_api_key_are_refused_rather_than_taken_as_one(tmp_path, monkeypatch):
    from ernie_serve.cli.serve import main

    monkeypatch.delenv("ERNIE_API_KEY", raising=False)
    monkeypatch.setenv("FD_API_KEY", "k1,k2")
    assert main(["--run-dir", str(tmp_path / "a")]) == 2
