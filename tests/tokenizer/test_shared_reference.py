"""The real chat template comes from the shared reference folder beside the checkout; where it is missing, the tests
that render it fail, naming where it was expected, instead of skipping (which passed a checkout without the data)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import TEMPLATE_IN_SHARED, real_template_path

HERE = Path(__file__).resolve().parent


def _git(*args: str) -> None:
    subprocess.run(["git", *args], check=True, capture_output=True, timeout=60)


def _shared_beside(folder: Path) -> Path:
    template = folder.parent / "shared" / TEMPLATE_IN_SHARED
    template.parent.mkdir(parents=True)
    template.write_text("{{ messages }}")
    return template


def test_a_checkout_finds_the_template_in_its_sibling_shared_folder(tmp_path):
    checkout = tmp_path / "main"
    checkout.mkdir()
    template = _shared_beside(checkout)
    assert real_template_path(checkout) == template


def test_a_clone_of_a_local_checkout_finds_the_template_beside_that_checkout(tmp_path):
    origin = tmp_path / "box" / "main"
    origin.mkdir(parents=True)
    template = _shared_beside(origin)
    _git("init", "-q", str(origin))
    _git("-C", str(origin), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x")
    clone = tmp_path / "elsewhere" / "clone"
    _git("clone", "-q", str(origin), str(clone))
    assert real_template_path(clone) == template


def test_a_missing_template_fails_the_tests_that_need_it_naming_where_it_was_expected(tmp_path):
    checkout = tmp_path / "main"
    (checkout / "tests" / "tokenizer").mkdir(parents=True)
    shutil.copy(HERE / "conftest.py", checkout / "tests" / "tokenizer" / "conftest.py")
    (checkout / "tests" / "tokenizer" / "test_uses_it.py").write_text(
        "def test_renders(real_thinking_template):\n    assert real_thinking_template\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfs", str(checkout)],
                         cwd=checkout, capture_output=True, text=True, timeout=120)
    expected = tmp_path / "shared" / TEMPLATE_IN_SHARED
    assert run.returncode == 1 and "1 error" in run.stdout and "skipped" not in run.stdout, run.stdout
    assert "the real ERNIE-4.5 thinking chat template is missing" in run.stdout and str(expected) in run.stdout
