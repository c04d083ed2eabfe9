"""C kernels of the CPU serving path (the reference backend on CPU), as vLLM-CPU has its C++ ops.

One shared library built from every `*.c` here on first use (build.py), called through ctypes:
`cpu_gemm` (fp32 / int8 / int4 weights in a column-blocked layout, every routed expert of a layer in one call),
`cpu_attention` (decode attention straight from the paged cache) and `cpu_ops` (the fused small ops of a decoder
layer). Without a C compiler nothing is built and every caller keeps its Paddle path.
"""
