"""Process environment the CPU build of Paddle needs before it is first imported.

Paddle's CPU wheel links Intel MKL, which takes a slow generic code path on AMD processors
(measured on this project's 2-core AMD EPYC box: 512x1024x4096 fp32 matmul 167 ms by default,
55 ms with MKL_DEBUG_CPU_TYPE=5, equal to numpy/OpenBLAS). The variable is harmless elsewhere.
"""
import os

os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
# Paddle prints a ccache warning at import on machines without ccache; it is noise for a server.
os.environ.setdefault("FLAGS_print_ir", "0")
