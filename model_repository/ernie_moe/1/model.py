"""ernie_moe: the engine, decoupled, one AsyncEngine per instance (logic: ernie_serve.serving.engine_model)."""
import os

import triton_python_backend_utils as pb_utils

from ernie_serve.serving import pb
from ernie_serve.serving.instance_devices import pin_instance_gpus
from ernie_serve.serving.loading import engine_model
from ernie_serve.serving.metrics import EngineMetrics


class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"],
                  "instance": args.get("model_instance_name", "")}
        try:
            params = pb.model_parameters(args)
            # --data-parallel-size: this replica's own GPUs, before any framework touches CUDA
            pin_instance_gpus(args, int(params.get("tensor_parallel_size") or 1))
            self.model = engine_model(params, EngineMetrics(pb_utils, labels), parent_pid=os.getppid())
        except Exception as e:
            raise pb_utils.TritonModelException(f"ernie_moe: engine failed to start: {e}")

    def execute(self, requests):
        for request in requests:
            self.model.submit(pb.inputs_of(pb_utils, request), pb.DecoupledSink(pb_utils, request),
                              request.request_id())
        return None

    def finalize(self):
        # Server shutdown: in-flight requests are aborted and each gets CANCELLED + FINAL.
        self.model.shutdown(drain=False)
