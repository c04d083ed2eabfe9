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
    for f in Path(checkpoint).iterdir():
        if f.is_file() and not (snapshot / f.name).exists():
            (snapshot / f.name).symlink_to(f.resolve())
    return snapshot


if __name__ == "__main__":  # python tests/hf_hub_cache.py HF_HOME MODEL_ID [MODEL_ID ...]: the tiny model under each
    from ernie_serve.demo.tiny_model import ensure_tiny_model

    tiny = ensure_tiny_model()
    for name in sys.argv[2:]:
        print(add_model(Path(sys.argv[1]), name, tiny))
