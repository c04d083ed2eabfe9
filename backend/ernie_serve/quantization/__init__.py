"""Quantized weights for ERNIE-4.5 serving: the formats (pack / unpack, scale layouts) and the plan of which method
each layer takes. NumPy only, a leaf both backends and the CPU kernels build on; the reference backend's quantized
layers are model/quantized_layers.py, and writing a quantized checkpoint is model/quantize_checkpoint.py.

Method names follow FastDeploy's --quantization values: wint8, wint4, block_wise_fp8, wint2, w4a8.
"""

from ernie_serve.quantization.formats import (  # noqa: F401
    dequantize_weight_only,
    quantize_weight_only,
)

METHODS = ("wint8", "wint4", "block_wise_fp8", "wint2", "w4a8")
