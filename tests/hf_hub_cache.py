"""A Hugging Face cache laid out as huggingface_hub writes it, holding the embedded tiny checkpoint under a real
model id, so `--model org/name` resolves offline (HF_HUB_OFFLINE=1) in tests and scripts/seed_deployments.sh."""
from __future__ import annotations

import sys
from pathlib import Path

REVISION = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as the hub names snapshots


def add_model(hf_home: Path, model_id: str, checkpoint: Path, revision: str = REVISION) -> Path:
    """<hf_home>/hub/models--org--name/snapshots/<rev>/ with the checkpoint's files linked in, refs/main naming
    <rev> (what snapshot_download reads when it may not ask the hub). Returns the snapshot directory."""
    repo = Path(hf_home) / "hub" / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for f in Path(checkpoint).iterdir():  # files, and the rank0/ .. directories of a pre-sharded checkpoint
        if not (snapshot / f.name).exists() and not f.name.startswith("."):
            (snapshot / f.name).symlink_to(f.resolve())
    return snapshot


def serve_mirror(repos: dict[str, Path], revision: str = REVISION):
    """A local stand-in for the hub at HF_ENDPOINT: the routes snapshot_download calls (repo info, the file tree,
    HEAD / GET of each file under resolve/<rev>/), serving each repo id from a directory. Returns the running
    ThreadingHTTPServer (its server_address names the port); shut it down when done."""
    import hashlib
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import unquote, urlparse

    def files(root: Path) -> list[Path]:
        return sorted(f for f in Path(root).rglob("*") if f.is_file())

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def reply(self, code: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(code)
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            path = unquote(urlparse(self.path).path)
            for repo, root in repos.items():
                if path.startswith(f"/api/models/{repo}/revision/"):
                    info = {"id": repo, "sha": revision,
                            "siblings": [{"rfilename": str(f.relative_to(root))} for f in files(root)]}
                    return self.reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
                if path.startswith(f"/api/models/{repo}/tree/"):
                    tree = [{"type": "file", "path": str(f.relative_to(root)), "size": f.stat().st_size,
                             "oid": hashlib.sha1(f.read_bytes()).hexdigest()} for f in files(root)]
                    return self.reply(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
                if path.startswith(f"/{repo}/resolve/"):
                    f = Path(root) / path[len(f"/{repo}/resolve/"):].split("/", 1)[1]
                    if f.is_file():
                        data = f.read_bytes()
                        return self.reply(200, data, {"X-Repo-Commit": revision, "Content-Type": "application/octet-stream",
                                                      "ETag": f'"{hashlib.sha1(data).hexdigest()}"'})
            self.reply(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound",
                                                                    "Content-Type": "application/json"})

        do_HEAD = do_GET

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def write_paddle_layout(checkpoint: Path, out: Path) -> Path:
    """The same weights in the "-Paddle" layout (ernie. prefix, fused qkv / up_gate), as the seeds' -Paddle ids
    hold: written once, reused while it exists."""
    import shutil

    from safetensors.numpy import load_file

    from ernie_serve.demo.tiny_model import _write_weights

    out = Path(out)
    if (out / "model.safetensors.index.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(checkpoint) / name, out / name)
    tensors = {}
    for shard in sorted(Path(checkpoint).glob("*.safetensors")):
        tensors.update(load_file(shard))
    _write_weights(out, "tiny", "paddle", tensors)
    return out


if __name__ == "__main__":
    # python tests/hf_hub_cache.py HF_HOME MODEL_ID[=CHECKPOINT_DIR] ...: each id holding that checkpoint, by
    # default the embedded tiny model
    from ernie_serve.demo.tiny_model import ensure_tiny_model

    for arg in sys.argv[2:]:
        name, _, ckpt = arg.partition("=")
        print(add_model(Path(sys.argv[1]), name, Path(ckpt) if ckpt else ensure_tiny_model()))
