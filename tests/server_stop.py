"""Stop a test's tritonserver and check that nothing held it: every request a test made has ended (disconnects and
timeouts cancelled theirs), so the server must not sit out its exit timeout for a leaked one. Not a speed bound:
idle takes a few seconds, a leak the whole exit_timeout."""
from __future__ import annotations

import time


def stop_checked(server) -> None:
    t0 = time.monotonic()
    server.stop()
    seconds = time.monotonic() - t0
    full_log = server.log_tail(400)
    server.cleanup()
    assert "Exit timeout expired" not in full_log and seconds < server.exit_timeout, \
        f"tritonserver waited out its exit timeout ({seconds:.1f}s): a request stayed in flight"
