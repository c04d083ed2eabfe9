"""The `reference` execution backend: ERNIE-4.5 in Paddle on the CPU (model/), with the C kernels of cpu_kernels/
on its serving path. It is the kernels backend's oracle and the CPU product.

    shard.py     ModelShard, the StepExecutor the engine's model runner drives: one rank's model and paged KV cache
    loading.py   builds it from an EngineConfig: the weights (quantized as asked), the MTP head, the KV pool's size

Several ranks of either backend run under tensor_parallel/ (rank 0 in the engine's process, workers beside it).
"""
