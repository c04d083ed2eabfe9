"""ernie_bls: tokenizer -> engine -> parsing in one decoupled model, via BLS (logic: ernie_serve.serving.bls)."""
import threading

import triton_python_backend_utils as pb_utils

from ernie_serve.serving import pb
from ernie_serve.serving.bls import BlsPipeline
from ernie_serve.serving.loading import postprocessor


class TritonPythonModel:
    def initialize(self, args):
        self.pipeline = BlsPipeline(pb_utils, postprocessor(pb.model_parameters(args)))

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.pipeline.run, args=(request,), daemon=True).start()
        return None
