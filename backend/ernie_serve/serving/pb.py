"""pb_utils <-> plain Python, shared by the model.py adapters (which pass the pb_utils module in)."""
from __future__ import annotations

import json
import logging
import threading
from typing import Any

import numpy as np

from ..config import EngineConfig

log = logging.getLogger(__name__)


def inputs_of(pb: Any, request: Any) -> dict[str, np.ndarray]:
    """Every input tensor of a request by name, as numpy (strings are object arrays of bytes)."""
    return {t.name(): t.as_numpy() for t in request.inputs()}


def parameters_of(request: Any) -> dict[str, Any]:
    try:
        raw = request.parameters()
        return json.loads(raw) if raw else {}
    except Exception:  # noqa: BLE001 - parameters are optional extras
        return {}


def tensors(pb: Any, outputs: dict[str, np.ndarray]) -> list:
    return [pb.Tensor(name, value) for name, value in outputs.items()]


def error(pb: Any, code: str, message: str):
    codes = {"INVALID_ARG": pb.TritonError.INVALID_ARG, "UNAVAILABLE": pb.TritonError.UNAVAILABLE,
             "CANCELLED": pb.TritonError.CANCELLED, "INTERNAL": pb.TritonError.INTERNAL}
    return pb.TritonError(message, codes.get(code, pb.TritonError.INTERNAL))


def error_response(pb: Any, code: str, message: str):
    return pb.InferenceResponse(error=error(pb, code, message))


class DecoupledSink:
    """ResponseSink over a decoupled response sender (engine_model.ResponseSink).

    No Triton call is made for a request once its FINAL has gone out: the python backend frees the
    request's response factory when it forwards the FINAL, and `is_cancelled()` hands that factory's
    address to tritonserver, which then reads freed memory (measured: Signal 11 in
    TRITONBACKEND_ResponseFactoryIsCancelled when the cancel poller asked about a request another
    thread had just finished, 100 concurrent streams). One lock orders every call on the request.
    """

    def __init__(self, pb: Any, request: Any):
        self._pb = pb
        self._request = request
        self._sender = request.get_response_sender()
        self._lock = threading.Lock()
        self._closed = False

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None:
        self._send(self._pb.InferenceResponse(output_tensors=tensors(self._pb, outputs)), final)

    def send_error(self, code: str, message: str) -> None:
        self._send(error_response(self._pb, code, message), True)

    def send_final(self) -> None:
        self._send(None, True)

    def _send(self, response: Any, final: bool) -> None:
        flags = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        with self._lock:
            if self._closed:
                raise RuntimeError("a response after the request's FINAL")
            self._closed = final
            if response is None:
                self._sender.send(flags=flags)
            else:
                self._sender.send(response, flags=flags)

    def is_cancelled(self) -> bool:
        """False once the FINAL is sent (or being sent: the poller asks again on its next round)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return not self._closed and self._request.is_cancelled()
        finally:
            self._lock.release()


def model_parameters(args: dict) -> dict[str, str]:
    """config.pbtxt `parameters` as {key: string_value}."""
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}


def engine_config_from_parameters(params: dict[str, str]) -> EngineConfig:
    """EngineConfig from config.pbtxt parameters (FastDeploy names; "" means the default)."""
    from dataclasses import fields

    kinds = {f.name: f.type for f in fields(EngineConfig)}
    kwargs: dict[str, Any] = {}
    for key, raw in params.items():
        name = key.replace("-", "_")
        if name not in kinds or raw.strip() == "":
            continue
        kwargs[name] = parse_value(raw, str(kinds[name]))
    return EngineConfig.from_kwargs(**kwargs)


def parse_value(raw: str, type_name: str) -> Any:
    raw = raw.strip()
    if "bool" in type_name:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean, got {raw!r}")
    if "dict" in type_name:
        return json.loads(raw)
    if "int" in type_name and "float" not in type_name:
        return int(raw)
    if "float" in type_name:
        return float(raw)
    return raw
