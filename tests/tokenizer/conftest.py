"""Builds the demo tokenizer once per session; these tests need no model download."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

try:
    import ernie_serve  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backend"))

from ernie_serve.demo.tokenizer_builder import build_tokenizer  # noqa: E402
from ernie_serve.tokenizer import ErnieTokenizer  # noqa: E402

CHECKOUT = Path(__file__).resolve().parents[2]
TEMPLATE_IN_SHARED = Path("reference") / "ernie45_thinking_chat_template.jinja"


def shared_dirs(checkout: Path = CHECKOUT) -> list[Path]:
    """Where the shared reference folder may be, in order: beside the checkout (CI checks the repository out with
    shared/ as its sibling), then beside the checkout this one was cloned from, when that is a local folder (the
    clean-clone check clones the working tree into a temporary folder, whose sibling has no shared/)."""
    dirs = [checkout.parent / "shared"]
    try:
        origin = subprocess.run(["git", "-C", str(checkout), "remote", "get-url", "origin"], capture_output=True,
                                text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        origin = ""
    if origin and Path(origin).is_dir():  # a local path; a URL names no folder here
        dirs.append(Path(origin).resolve().parent / "shared")
    return dirs


def real_template_path(checkout: Path = CHECKOUT) -> Path:
    """The model's own thinking chat template from the shared reference folder; raises FileNotFoundError naming
    every place it looked (a skip would let a checkout without the data pass without rendering it)."""
    places = [d / TEMPLATE_IN_SHARED for d in shared_dirs(checkout)]
    found = next((p for p in places if p.is_file()), None)
    if found is None:
        raise FileNotFoundError("the real ERNIE-4.5 thinking chat template is missing: the shared reference folder "
                                "is expected beside the repository's checkout, with the template at "
                                + " or ".join(str(p) for p in places))
    return found


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tok(tokenizer_dir: Path) -> ErnieTokenizer:
    return ErnieTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def real_thinking_template() -> str:
    try:
        return real_template_path().read_text(encoding="utf-8")
    except FileNotFoundError as e:
        pytest.fail(str(e), pytrace=False)
