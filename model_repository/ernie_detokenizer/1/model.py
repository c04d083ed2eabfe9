"""ernie_detokenizer: engine steps -> text / reasoning / tool-call deltas (logic: ernie_serve.serving.postprocess)."""
import triton_python_backend_utils as pb_utils

from ernie_serve.serving import pb
from ernie_serve.serving.errors import ServingError
from ernie_serve.serving.loading import postprocessor


class TritonPythonModel:
    def initialize(self, args):
        self.post = postprocessor(pb.model_parameters(args))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = self.post.process(pb.inputs_of(pb_utils, request), is_cancelled=request.is_cancelled)
                responses.append(pb_utils.InferenceResponse(output_tensors=pb.tensors(pb_utils, outputs)))
            except ServingError as e:
                responses.append(pb.error_response(pb_utils, e.code, str(e)))
            except Exception as e:  # noqa: BLE001
                responses.append(pb.error_response(pb_utils, "INTERNAL", f"{type(e).__name__}: {e}"))
        return responses
