"""Helpers shared by the e2e tests."""
from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path


def scrape(server) -> dict[str, float]:
    """ernie:* samples from the metrics port, summed over label sets, by '<name>{<key labels>}' and name."""
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(ernie:[\w:]+)(\{[^}]*\})?\s+([-+0-9.eEinfa]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def scrape_once_blocks_are_held(server, timeout: float = 10.0) -> dict[str, float]:
    """A scrape showing KV blocks in use, waited for: the gauges move on the engine thread after each step,
    so on a loaded box a scrape right after a streamed token can come first."""
    deadline = time.monotonic() + timeout
    now = scrape(server)
    while now["ernie:kv_cache_free_blocks"] == now["ernie:kv_cache_total_blocks"] and time.monotonic() < deadline:
        time.sleep(0.1)
        now = scrape(server)
    return now


def wait_for_health(url: str, timeout: float, proc=None) -> None:
    """Until the OpenAI shim at `url` answers /health (it comes up after tritonserver); fails early if `proc`, the
    server's process, exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, f"the server exited {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}/health did not answer in {timeout:.0f} s")


def wait_for_banner(log, timeout: float, proc) -> dict[str, int]:
    """The ports an `ernie-serve` process started with ports of 0 got (cli/serve.py's banner_ports), read from its
    output file `log` once it printed them; fails early if `proc` exits first."""
    from ernie_serve.cli.serve import banner_ports

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ports = banner_ports(Path(log).read_text(errors="replace"))
        if ports:
            return ports
        assert proc.poll() is None, f"ernie-serve exited {proc.returncode}:\n{Path(log).read_text()[-3000:]}"
        time.sleep(0.2)
    raise TimeoutError(f"ernie-serve printed no ready banner in {timeout:.0f} s")
