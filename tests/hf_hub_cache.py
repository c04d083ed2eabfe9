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
