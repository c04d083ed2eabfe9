"""The router tests start servers with the e2e and shim tests' own helpers (e2e_helpers, openai_shim_helpers)."""
from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for _sub in ("e2e", "openai"):
    if str(_TESTS / _sub) not in sys.path:
        sys.path.append(str(_TESTS / _sub))
