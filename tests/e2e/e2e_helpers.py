"""Helpers shared by the e2e tests."""
from __future__ import annotations

import re
import urllib.request


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
