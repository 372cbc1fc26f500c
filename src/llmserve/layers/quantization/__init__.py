"""Weight formats for linear layers, chosen by configuration (model files never name one).

``WeightFormat`` is what a model constructor receives and hands, unopened, to every linear
layer and to the vocabulary embedding; the layer asks it for a ``LinearMethod`` that owns
the weight's storage, loading and matrix product. Methods are registered by name; the
CLI's ``--quantization`` choices come from the registry.
"""

from llmserve.layers.quantization.base import (
    BlockQuantized,
    LinearMethod,
    WeightFormat,
    get_linear_method_class,
    list_quantization_methods,
    register_linear_method,
)

__all__ = [
    "BlockQuantized",
    "LinearMethod",
    "WeightFormat",
    "get_linear_method_class",
    "list_quantization_methods",
    "register_linear_method",
]
