"""The code runs on the lowest Python the package declares (requires-python), which is also the NGC 24.10 image's
(3.10): vermin finds no construct newer than that floor in what the package and the image run."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("backend", "client", "kernels", "model_repository", "scripts")


def declared_floor() -> str:
    """requires-python's lower bound (read without tomllib, which 3.10 lacks)."""
    m = re.search(r'^requires-python\s*=\s*">=\s*(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert m, "pyproject.toml: requires-python is not a plain >=X.Y"
    return m.group(1)


def test_no_construct_newer_than_the_declared_python_floor():
    vermin = Path(sys.executable).with_name("vermin")
    if not vermin.exists():
        pytest.fail("vermin is not installed: pip install -e '.[test]'")
    floor = declared_floor()
    proc = subprocess.run([str(vermin), f"-t={floor}-", "--no-tips", "--violations", *CHECKED], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"code newer than Python {floor} (requires-python):\n{proc.stdout}{proc.stderr}"


def test_the_image_python_is_not_below_the_floor():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from check_image_recipe import IMAGE_PYTHON
    finally:
        sys.path.pop(0)
    floor = tuple(int(x) for x in declared_floor().split("."))
    for image, python in IMAGE_PYTHON.items():
        assert tuple(int(x) for x in python.split(".")) >= floor, f"{image} runs Python {python}, below {floor}"
