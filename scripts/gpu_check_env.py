"""The process set-up both GPU checks make before anything imports triton or a tensor framework: the interpreter for
--cpu-smoke runs, the tensor framework the check drives, and the repository's packages on sys.path (the lent GPU
boxes run these scripts from a copied tree, without an install)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepare(framework: str) -> bool:
    """Set the process up for a check on `framework`; True for a --cpu-smoke run (triton's interpreter)."""
    smoke = "--cpu-smoke" in sys.argv
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    os.environ["ERNIE_TENSOR_FRAMEWORK"] = framework
    for sub in ("backend", "kernels", "scripts"):
        if str(ROOT / sub) not in sys.path:
            sys.path.insert(0, str(ROOT / sub))
    return smoke
