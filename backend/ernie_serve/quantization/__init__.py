"""Quantized weights for ERNIE-4.5 serving: formats (pack/unpack) and CPU reference layers.

Method names follow FastDeploy's --quantization values: wint8, wint4, block_wise_fp8, wint2, w4a8.
"""

from ernie_serve.quantization.formats import (  # noqa: F401
    dequantize_weight_only,
    quantize_weight_only,
)

METHODS = ("wint8", "wint4", "block_wise_fp8", "wint2", "w4a8")
