"""aiperf (NVIDIA's load generator, in .peers/aiperf) for the serving benchmark: one load point's command
line, the metrics read back from its JSON export, and the same metrics computed from our own timings.

aiperf's definitions, which `PointMetrics.from_samples` follows so that the offline engine's figures
mean the same thing:
  TTFT    request start -> first response that carries text (a chunk holding only part of a
          UTF-8 character carries none)
  ITL     per request, (request latency - TTFT) / (output tokens - 1); p50/p99 are over requests
  tok/s   all output tokens / benchmark duration (first request start -> last response)
  p-th    linear interpolation between order statistics (numpy's default)
Token counts are the server's own (`usage`, with --use-server-token-count), not aiperf re-tokenizing
the streamed text.

Standard library only.
"""
from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

EXPORT_FILE = "profile_export_aiperf.json"
# aiperf 0.13's plain --concurrency mode re-checks for a free slot in a loop that only yields to its event
# loop: its timing_manager process keeps ~0.55 of a core busy for the whole run, a quarter
# of a 2-core host taken from the server it measures. Given a request rate too, it checks once per tick
# instead, so a concurrency point also sets this rate: a freed slot is refilled at the next tick (<= 20 ms
# later), one request per tick.
CONCURRENCY_TICK_RATE = 50.0


@dataclass(frozen=True)
class LoadPoint:
    """Requests sent either at a constant rate (open loop) or keeping `concurrency` in flight (closed loop)."""
    name: str
    num_requests: int
    concurrency: int | None = None
    request_rate: float | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError(f"load point {self.name!r}: give exactly one of concurrency and request_rate")
        if self.num_requests < 1:
            raise ValueError(f"load point {self.name!r}: num_requests must be >= 1, got {self.num_requests}")

    @property
    def label(self) -> str:
        if self.request_rate is not None:
            return f"{self.request_rate:g} req/s x{self.num_requests}"
        return f"concurrency {self.concurrency} x{self.num_requests}"

    @property
    def tick_s(self) -> float:
        """aiperf's interval between two send attempts (constant arrival pattern)."""
        return 1.0 / (self.request_rate if self.request_rate is not None else CONCURRENCY_TICK_RATE)


class Arrivals:
    """When aiperf sends each request of a load point, from when earlier ones finished: the schedule the
    offline replay follows. Times are seconds from the start of the point.

    Every tick (tick_s apart) aiperf sends at most one request; open loop it always can, closed loop only
    while fewer than `concurrency` are in flight (a tick without a free slot is skipped)."""

    def __init__(self, point: LoadPoint):
        self.point = point
        self.sent = 0
        self._next_tick = 0.0
        self._free_slots: deque[float] = deque([0.0] * point.concurrency) if point.concurrency else deque()

    def finished(self, t: float) -> None:
        """A request returned at `t`: closed loop, its slot is free from then on."""
        if self.point.concurrency is not None:
            self._free_slots.append(t)

    def next_send(self) -> float | None:
        """When the next request goes out if nothing else finishes first (None: not until one does)."""
        if self.sent == self.point.num_requests:
            return None
        if self.point.concurrency is None:
            return self._next_tick
        if not self._free_slots:
            return None
        tick = self.point.tick_s
        return max(self._next_tick, math.ceil(self._free_slots[0] / tick - 1e-9) * tick)

    def due(self, now: float) -> list[float]:
        """Send times of the requests sent by `now` and not yet handed out, in order."""
        out = []
        while (t := self.next_send()) is not None and t <= now:
            out.append(t)
            self.sent += 1
            self._next_tick = t + self.point.tick_s
            if self.point.concurrency is not None:
                self._free_slots.popleft()
        return out


def aiperf_command(aiperf: Path, url: str, model: str, tokenizer: Path, input_file: Path, point: LoadPoint,
                   extra_inputs: dict, artifact_dir: Path, request_timeout_s: float) -> list[str]:
    cmd = [str(aiperf), "profile", "--model", model, "--url", url,
           "--endpoint-type", "completions", "--streaming", "--use-server-token-count",
           "--tokenizer", str(tokenizer),
           "--input-file", str(input_file), "--custom-dataset-type", "single_turn",
           "--dataset-sampling-strategy", "sequential",
           "--request-count", str(point.num_requests),
           "--extra-inputs", json.dumps(extra_inputs),
           "--request-timeout-seconds", str(request_timeout_s),
           # aiperf shares the cores with the server: one worker, one record processor, and no scraping
           # of the server's /metrics (it polls every second or so) or of GPU telemetry
           "--workers-max", "1", "--record-processor-service-count", "1", "--no-server-metrics",
           "--no-gpu-telemetry",
           "--random-seed", "0", "--ui-type", "none", "--output-artifact-dir", str(artifact_dir)]
    if point.concurrency is not None:
        cmd += ["--concurrency", str(point.concurrency)]
    return cmd + ["--request-rate", f"{1.0 / point.tick_s:g}", "--arrival-pattern", "constant"]


@dataclass
class PointMetrics:
    requests: int  # completed without error
    errors: int
    duration_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    ttft_avg_ms: float
    itl_avg_ms: float
    prompt_tokens: tuple[int, int]  # min, max over requests
    output_tokens: tuple[int, int]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "PointMetrics":
        return cls(**{**data, "prompt_tokens": tuple(data["prompt_tokens"]),
                      "output_tokens": tuple(data["output_tokens"])})

    @classmethod
    def from_samples(cls, ttft_s: Sequence[float], latency_s: Sequence[float], prompt_tokens: Sequence[int],
                     output_tokens: Sequence[int], duration_s: float) -> "PointMetrics":
        """aiperf's metrics from per-request timings (seconds from each request's start)."""
        itl = [1000 * (lat - t) / (n - 1) for t, lat, n in zip(ttft_s, latency_s, output_tokens) if n > 1]
        ttft = [t * 1000 for t in ttft_s]
        return cls(len(latency_s), 0, round(duration_s, 3), round(sum(output_tokens) / duration_s, 2),
                   round(percentile(ttft, 50), 2), round(percentile(ttft, 99), 2),
                   round(percentile(itl, 50), 2), round(percentile(itl, 99), 2),
                   round(_mean(ttft), 2), round(_mean(itl), 2),
                   (min(prompt_tokens), max(prompt_tokens)), (min(output_tokens), max(output_tokens)))

    def problems(self, point: LoadPoint, prompt_len: int, output_len: int) -> list[str]:
        """Why this point's figures are not the trace's work (empty: they are)."""
        out = []
        if self.errors:
            out.append(f"{self.errors} requests failed")
        if self.requests != point.num_requests:
            out.append(f"{self.requests} of {point.num_requests} requests completed")
        if self.prompt_tokens != (prompt_len, prompt_len):
            out.append(f"prompt tokens {self.prompt_tokens[0]}..{self.prompt_tokens[1]}, trace has {prompt_len} "
                       "(the server tokenized the text differently)")
        if self.output_tokens != (output_len, output_len):
            out.append(f"output tokens {self.output_tokens[0]}..{self.output_tokens[1]}, asked for {output_len}")
        return out


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def read_export(artifact_dir: Path) -> PointMetrics:
    """The figures of one aiperf run from its summary export (profile_export_aiperf.json)."""
    path = Path(artifact_dir) / EXPORT_FILE
    data = json.loads(path.read_text())
    if data.get("was_cancelled"):
        raise ValueError(f"{path}: aiperf reports the run as cancelled")

    def stat(name: str, key: str) -> float:
        if name not in data:  # aiperf leaves out metrics it could not compute (e.g. every request failed)
            return math.nan
        return float(data[name][key])

    def count(name: str) -> int:
        return int(data[name]["avg"]) if name in data else 0

    return PointMetrics(
        requests=count("request_count"), errors=count("error_request_count"),
        duration_s=round(stat("benchmark_duration", "avg"), 3),
        output_tok_s=round(stat("output_token_throughput", "avg"), 2),
        ttft_p50_ms=round(stat("time_to_first_token", "p50"), 2),
        ttft_p99_ms=round(stat("time_to_first_token", "p99"), 2),
        itl_p50_ms=round(stat("inter_token_latency", "p50"), 2),
        itl_p99_ms=round(stat("inter_token_latency", "p99"), 2),
        ttft_avg_ms=round(stat("time_to_first_token", "avg"), 2),
        itl_avg_ms=round(stat("inter_token_latency", "avg"), 2),
        prompt_tokens=_min_max(data, "input_sequence_length"),
        output_tokens=_min_max(data, "output_sequence_length"))


def _min_max(data: dict, name: str) -> tuple[int, int]:
    if name not in data:
        return (0, 0)
    return (int(data[name]["min"]), int(data[name]["max"]))
