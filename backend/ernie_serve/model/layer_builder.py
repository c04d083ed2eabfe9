"""What makes the model's weight-bearing layers: the seam between the model's structure and its weight formats.

The loader hands ErnieForCausalLM a LayerBuilder (vLLM's quant-method shape): `FLOAT_LAYERS` for a float
checkpoint, or model/quantized_layers.QuantizedLayers built from the checkpoint's or the flag's QuantPlan. The
model's modules (ernie.py, layers.py, moe.py) then never name a weight format, and a new format is a new builder,
not an edit to the layers that call it.
"""
from __future__ import annotations

from typing import Protocol

from paddle import nn

from .layers import Linear
from .moe import FusedExperts


class LayerBuilder(Protocol):
    def linear(self, in_features: int, out_features: int, layer_idx: int) -> nn.Layer:
        """A dense projection of decoder layer `layer_idx` (attention, dense MLP, shared experts), empty for the
        loader to fill."""

    def experts(self, num_experts: int, hidden_size: int, intermediate_size: int, layer_idx: int) -> nn.Layer:
        """The routed experts of MoE layer `layer_idx` (this rank's experts, or its slice of each), empty."""


class FloatLayers:
    """Float parameters (float32 as loaded; the serving layouts come after loading)."""

    def linear(self, in_features: int, out_features: int, layer_idx: int) -> nn.Layer:
        return Linear(in_features, out_features)

    def experts(self, num_experts: int, hidden_size: int, intermediate_size: int, layer_idx: int) -> nn.Layer:
        return FusedExperts(num_experts, hidden_size, intermediate_size)


FLOAT_LAYERS = FloatLayers()
