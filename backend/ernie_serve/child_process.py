"""What a process the engine starts needs, wherever it runs (the engine core, tensor-parallel ranks): the right
interpreter, and an end that follows its parent's."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1


def python_executable() -> str:
    """This interpreter: inside Triton's python stub sys.executable may be the stub, not python."""
    exe = Path(sys.executable)
    return str(exe) if exe.name.startswith("python") else "python3"


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux's PR_SET_PDEATHSIG): a child left behind by a killed server
    would hold its GPU and ports."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the call above took effect
        os._exit(1)
