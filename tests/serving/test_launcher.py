"""The launcher's own work, without a tritonserver (serving/launcher.py): the command line and environment it renders,
the backends folder it prepares, FD_LOG_DIR, the readiness check that refuses another server on the port, the cause it
reports when tritonserver exits while starting, and the children it kills with their whole session.

The tritonserver install is the real one the venv has (nvidia-pytriton); the processes are real, short-lived ones."""
from __future__ import annotations

import http.server
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from ernie_serve.paths import repo_root
from ernie_serve.serving.health import STUB_BINARY
from ernie_serve.serving.launcher import (ADMIN_KEY_HEADER, TritonInstall, TritonServer, _Child, find_tritonserver,
                                          prepare_backends, restricted_api_args, server_env)

WAIT = 30  # seconds: a hang detector for process exits, never a speed expectation


@pytest.fixture(autouse=True)
def _no_fd_log_dir(monkeypatch):
    monkeypatch.delenv("FD_LOG_DIR", raising=False)


@pytest.fixture(scope="module")
def install() -> TritonInstall:
    return find_tritonserver()


def _flags(cmd: list[str]) -> dict[str, str]:
    """--flag value pairs of a command line (a --flag=value argument is left out)."""
    return {a: b for a, b in zip(cmd, cmd[1:]) if a.startswith("--") and "=" not in a}


def test_the_command_binds_every_listener_to_the_host_and_its_port(tmp_path, install):
    server = TritonServer({"max-num-seqs": "4"}, http_port=1234, grpc_port=1235, metrics_port=1236, host="127.0.0.2",
                          run_dir=tmp_path, exit_timeout=7, extra_args=("--log-verbose", "1"))
    cmd = server.command(install, tmp_path / "repo", None)
    flags = _flags(cmd)
    assert cmd[0] == str(install.binary) and cmd[-2:] == ["--log-verbose", "1"]
    assert {k: flags[k] for k in ("--http-address", "--grpc-address", "--metrics-address")} == \
        dict.fromkeys(("--http-address", "--grpc-address", "--metrics-address"), "127.0.0.2")
    assert (flags["--http-port"], flags["--grpc-port"], flags["--metrics-port"]) == ("1234", "1235", "1236")
    assert flags["--model-repository"] == str(tmp_path / "repo") and flags["--id"] == server.server_id
    assert flags["--exit-timeout-secs"] == "7" and flags["--strict-readiness"] == "true"
    assert "--backend-directory" not in flags and server.settings == {"max_num_seqs": "4"}


def test_the_command_names_the_prepared_backends_and_their_caches(tmp_path, install):
    server = TritonServer(run_dir=tmp_path)
    backends = tmp_path / "backends"
    assert _flags(server.command(install, tmp_path, backends))["--backend-directory"] == str(backends)
    assert "--cache-directory" not in server.command(install, tmp_path, backends)
    (tmp_path / "caches").mkdir()
    assert _flags(server.command(install, tmp_path, backends))["--cache-directory"] == str(tmp_path / "caches")


def test_the_admin_apis_need_the_servers_own_key_and_the_client_apis_the_api_key(tmp_path, install):
    assert restricted_api_args("adm", None) == [
        f"--http-restricted-api=shared-memory,model-repository,logging,trace:{ADMIN_KEY_HEADER}=adm",
        f"--grpc-restricted-protocol=shared-memory,model-repository,logging,trace:{ADMIN_KEY_HEADER}=adm"]
    assert restricted_api_args("adm", "sk")[1::2] == [
        "--http-restricted-api=inference,metadata,model-config,statistics:authorization=Bearer sk",
        "--grpc-restricted-protocol=inference,metadata,model-config,statistics:authorization=Bearer sk"]
    one, two = TritonServer(run_dir=tmp_path, api_key="sk"), TritonServer(run_dir=tmp_path, api_key="sk")
    assert one.admin_api_key != two.admin_api_key and len(one.admin_api_key) >= 24  # fresh, never the API key
    assert set(restricted_api_args(one.admin_api_key, "sk")) <= set(one.command(install, tmp_path, None))


def test_the_environment_puts_this_python_first_and_the_packages_on_pythonpath(install, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = server_env(install)
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)  # the stub finds the venv by it
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(install.lib_dir)
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert paths[:3] == [str(repo_root() / d) for d in ("backend", "kernels", "client")]
    assert paths[-1] == "/elsewhere" and any(p.endswith("site-packages") for p in paths)


def test_the_backends_folder_holds_the_python_backend_with_the_stub_of_this_python(tmp_path, install):
    backends = prepare_backends(install, tmp_path)
    python = backends / "python"
    assert (python / STUB_BINARY).read_bytes() == (install.stub_dir / STUB_BINARY).read_bytes()
    assert (python / "libtriton_python.so").exists() and os.access(python / STUB_BINARY, os.X_OK)
    (python / "libtriton_python.so").write_bytes(b"kept")  # a restart reuses what is there (a dying stub's is busy)
    assert prepare_backends(install, tmp_path) == backends and (python / "libtriton_python.so").read_bytes() == b"kept"
    on_path = TritonInstall(install.binary, None, None, None)  # the NGC image: its own backends, nothing to prepare
    assert prepare_backends(on_path, tmp_path / "ngc") is None and not (tmp_path / "ngc").exists()


def test_fd_log_dir_takes_both_logs_and_is_created(tmp_path, monkeypatch):
    assert TritonServer(run_dir=tmp_path).log_path == tmp_path / "tritonserver.log"
    assert TritonServer(run_dir=tmp_path).openai_log_path is None  # the shim logs to stderr
    monkeypatch.setenv("FD_LOG_DIR", str(tmp_path / "logs" / "fd"))
    server = TritonServer(run_dir=tmp_path)
    assert server.log_path == tmp_path / "logs" / "fd" / "tritonserver.log"
    assert server.openai_log_path == tmp_path / "logs" / "fd" / "api_server.log" and server.log_path.parent.is_dir()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FD_LOG_DIR", str(tmp_path / "file" / "sub"))
    with pytest.raises(ValueError, match=r"FD_LOG_DIR='.*/file/sub': cannot create it"):
        TritonServer(run_dir=tmp_path)


def test_the_shim_gets_the_served_models_tokenizer_length_and_chat_template(tmp_path, tiny_model_dir):
    default = TritonServer({"model": str(tiny_model_dir)}, run_dir=tmp_path)._shim_tokenizer_args()
    assert default == ["--tokenizer", str(tiny_model_dir), "--max-model-len", "2048"]
    own = TritonServer({"model": str(tiny_model_dir), "tokenizer": str(tmp_path), "max-model-len": "512",
                        "chat_template": "x.jinja"}, run_dir=tmp_path)._shim_tokenizer_args()
    assert own == ["--tokenizer", str(tmp_path), "--max-model-len", "512", "--chat-template", "x.jinja"]


class _Stranger(http.server.BaseHTTPRequestHandler):
    """Another server on the port: healthy, under the name it was given."""
    name = "someone-else"

    def do_GET(self):  # noqa: N802 (the http.server API)
        body = json.dumps({"name": self.server.name}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_ready_means_this_launchers_own_server_answers_not_another_on_the_port(tmp_path):
    stranger = http.server.HTTPServer(("127.0.0.1", 0), _Stranger)
    stranger.name = "someone-else"
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    try:
        server = TritonServer(http_port=stranger.server_address[1], run_dir=tmp_path)
        assert not server.is_ready()
        stranger.name = server.server_id
        assert server.is_ready()
    finally:
        stranger.shutdown()
        stranger.server_close()
    assert not server.is_ready()  # nothing on the port


TABLE = """| Model     | Version | Status                                            |
| ernie_moe | 1       | UNAVAILABLE: Internal: tensor_parallel_size=8 does not divide 4 |"""


def test_a_server_that_exits_while_starting_is_reported_with_its_log_and_the_models_cause(tmp_path):
    server = TritonServer(http_port=9, run_dir=tmp_path)
    with open(server.log_path, "wb") as log:
        server._server = _Child([sys.executable, "-c", f"print({TABLE!r}); raise SystemExit(3)"], stdout=log)
    with pytest.raises(RuntimeError) as e:
        server.wait_ready(WAIT)
    assert str(e.value).startswith("tritonserver exited with 3 while starting:")
    assert str(e.value).endswith("why:\n  model 'ernie_moe': tensor_parallel_size=8 does not divide 4")
    server.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _session_child(tmp_path: Path) -> tuple[_Child, int]:
    """A child in a session of its own that forks a grandchild (a tritonserver and its python stub)."""
    pid_file = tmp_path / "grandchild"
    child = _Child(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"])
    deadline = time.monotonic() + WAIT
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, "the child did not start its grandchild"
        time.sleep(0.05)
    return child, int(pid_file.read_text())


def test_kill_session_takes_the_child_and_everything_it_forked(tmp_path):
    child, grandchild = _session_child(tmp_path)
    assert os.getsid(grandchild) == child.proc.pid
    child.kill_session()
    assert child.proc.returncode == -signal.SIGKILL and not _alive(grandchild)


def test_the_reaper_kills_the_session_once_the_launcher_is_gone(tmp_path):
    child, grandchild = _session_child(tmp_path)
    child._reaper.stdin.close()  # what the launcher's death does to the reaper's stdin
    assert child._reaper.wait(WAIT) == 0
    assert child.proc.wait(WAIT) == -signal.SIGKILL
    deadline = time.monotonic() + WAIT
    while _alive(grandchild):
        assert time.monotonic() < deadline, "the grandchild outlived the reaper"
        time.sleep(0.05)
