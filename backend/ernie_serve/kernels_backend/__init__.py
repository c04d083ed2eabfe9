"""The `kernels` execution backend: the engine's model runs through the triton-lang kernels (ernie_kernels)
on device tensors, in Paddle or torch (framework.py), with CUDA graphs for decode steps.

    weights.py       checkpoint -> host arrays (no Paddle needed) -> device tensors in the kernels' formats
    kv_cache.py      the paged KV cache as device tensors (float, or C8 int8 with static / dynamic scales)
    model.py         the forward: RMSNorm+residual, qkv GEMM, RoPE, KV write, unified attention, router, fused MoE
    step_buffers.py  a step's index data in persistent device buffers
    cuda_graphs.py   decode steps captured per batch-size bucket and replayed
    shard.py         the StepExecutor the engine's model runner drives (as reference_backend/shard.py for `reference`)
    loading.py       builds it from an EngineConfig: the framework, the weights, the KV pool size, the graphs

The reference backend (model/, reference_backend/shard.py) is this path's oracle: tests run both on the same
checkpoints and compare tokens and logits.
"""
