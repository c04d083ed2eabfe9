"""ernie_tokenizer: request tensors -> prompt ids + request JSON (logic: ernie_serve.serving.preprocess)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from ernie_serve.serving import pb
from ernie_serve.serving.errors import InvalidInput
from ernie_serve.serving.loading import preprocessor
from ernie_serve.serving.request import parse_request
from ernie_serve.serving.preprocess import dumps


class TritonPythonModel:
    def initialize(self, args):
        try:
            self.pre = preprocessor(pb.model_parameters(args))
        except Exception as e:  # a bad --reasoning-parser etc. must stop the server with the reason
            raise pb_utils.TritonModelException(f"ernie_tokenizer: {e}")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                req = parse_request(pb.inputs_of(pb_utils, request), pb.parameters_of(request))
                ids, payload = self.pre.encode(req)
                responses.append(pb_utils.InferenceResponse(output_tensors=pb.tensors(pb_utils, {
                    "input_ids": np.array([ids], dtype=np.int32),
                    "request_json": np.array([[dumps(payload).encode("utf-8")]], dtype=np.object_),
                })))
            except InvalidInput as e:
                responses.append(pb.error_response(pb_utils, "INVALID_ARG", str(e)))
            except Exception as e:  # noqa: BLE001 - every request gets an answer
                responses.append(pb.error_response(pb_utils, "INTERNAL", f"{type(e).__name__}: {e}"))
        return responses
