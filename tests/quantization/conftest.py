"""Make the in-tree packages importable when the project is not pip-installed."""

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
for sub in ("backend", "kernels"):
    p = str(_ROOT / sub)
    if p not in sys.path:
        sys.path.insert(0, p)
