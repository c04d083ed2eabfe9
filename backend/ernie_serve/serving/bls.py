"""ernie_bls: the ensemble's chain inside one decoupled python model.

BLS calls: ernie_tokenizer (one response), then ernie_moe with exec(decoupled=True) (one response
per engine step); each engine response goes through this model's own Postprocessor, so a token
costs no third model call. The client request is this model's own, so its cancellation is seen
directly; the engine is told through the same abort channel the detokenizer uses.
"""
from __future__ import annotations

import logging
from typing import Any

from . import pb as pbx
from .engine_response import FINAL, HEADER
from .engine_response import OUTPUT_NAMES as ENGINE_OUTPUT_NAMES
from .errors import ServingError

log = logging.getLogger(__name__)
TOKENIZER_OUTPUTS = ["input_ids", "request_json"]
ENGINE_OUTPUTS = list(ENGINE_OUTPUT_NAMES)


class BlsPipeline:
    def __init__(self, pb: Any, post, tokenizer_model: str = "ernie_tokenizer", engine_model: str = "ernie_moe"):
        self.pb = pb
        self.post = post
        self.tokenizer_model = tokenizer_model
        self.engine_model = engine_model

    def run(self, request: Any) -> None:
        pb = self.pb
        sender = request.get_response_sender()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            tok = pb.InferenceRequest(model_name=self.tokenizer_model, inputs=request.inputs(),
                                      requested_output_names=TOKENIZER_OUTPUTS,
                                      parameters=pbx.parameters_of(request)).exec()
            if tok.has_error():
                sender.send(pb.InferenceResponse(error=tok.error()), flags=final)
                return
            engine_inputs = [pb.get_output_tensor_by_name(tok, n) for n in TOKENIZER_OUTPUTS]
            stream = pb.InferenceRequest(model_name=self.engine_model, inputs=engine_inputs,
                                         requested_output_names=ENGINE_OUTPUTS).exec(decoupled=True)
            for resp in stream:
                if resp.has_error():
                    sender.send(pb.InferenceResponse(error=resp.error()), flags=final)
                    return
                if not resp.output_tensors():  # the engine's empty FINAL
                    continue
                inputs = {t.name(): t.as_numpy() for t in resp.output_tensors()}
                if request.is_cancelled():
                    self.post.process(inputs, is_cancelled=True)  # drops the state, tells the engine
                    sender.send(pbx.error_response(pb, "CANCELLED", "request cancelled"), flags=final)
                    return
                outputs = self.post.process(inputs)
                done = is_final(inputs)
                sender.send(pb.InferenceResponse(output_tensors=pbx.tensors(pb, outputs)),
                            flags=final if done else 0)
                if done:
                    return
            sender.send(flags=final)
        except ServingError as e:
            sender.send(pbx.error_response(pb, e.code, str(e)), flags=final)
        except Exception as e:  # noqa: BLE001 - never leave the client without its FINAL
            log.exception("ernie_bls request failed")
            sender.send(pbx.error_response(pb, "INTERNAL", f"{type(e).__name__}: {e}"), flags=final)


def is_final(inputs: dict) -> bool:
    """Whether an ernie_moe response is its request's last (engine_response's header flags)."""
    return bool(int(inputs["engine_header"].reshape(-1)[HEADER.index("flags")]) & FINAL)
