"""Host (CPU) fallback ops: what the NPU cannot run, the host runs on whole DRAM tensors.

A ``HostOp`` command names one of these by string, so programs stay serialisable. Each
function takes the input arrays and the command's attrs and returns the output arrays.
"""
from __future__ import annotations

import numpy as np

HOST_OPS: dict = {}


def register_host_op(name: str):
    def deco(fn):
        HOST_OPS[name] = fn
        return fn
    return deco


@register_host_op("copy")
def _copy(inputs, attrs):
    return [inputs[0].copy()]


@register_host_op("argmax")
def _argmax(inputs, attrs):
    x = inputs[0].astype(np.float32)
    return [np.argmax(x.reshape(-1, x.shape[-1]), axis=-1).astype(np.int32)]


@register_host_op("softmax")
def _softmax(inputs, attrs):
    x = inputs[0].astype(np.float32)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return [(e / e.sum(axis=-1, keepdims=True)).astype(inputs[0].dtype)]


@register_host_op("add")
def _add(inputs, attrs):
    return [(inputs[0].astype(np.float32) + inputs[1].astype(np.float32)).astype(inputs[0].dtype)]


#: elementwise ops the host runs for a phase program (a Relax op ``relax.<name>`` on NPU
#: data that no NPU kernel takes): name -> (numpy function on float32, FLOPs per element).
#: Transcendentals are counted as 8 FLOPs, what a vectorised libm spends on one.
HOST_UNARY = {
    "tanh": (np.tanh, 8), "exp": (np.exp, 8), "log": (np.log, 8), "sin": (np.sin, 8),
    "cos": (np.cos, 8), "sigmoid": (lambda x: 1.0 / (1.0 + np.exp(-x)), 8),
    "sqrt": (np.sqrt, 1), "rsqrt": (lambda x: 1.0 / np.sqrt(x), 2),
    "negative": (np.negative, 1), "abs": (np.abs, 1),
}
HOST_BINARY = {
    "add": (np.add, 1), "subtract": (np.subtract, 1), "multiply": (np.multiply, 1),
    "divide": (np.divide, 1), "maximum": (np.maximum, 1), "minimum": (np.minimum, 1),
    "power": (np.power, 8),
}


def shape_attr(shape) -> str:
    """A shape as a HostOp attribute (attributes are JSON scalars): ``"1x1x512"``."""
    return "x".join(str(int(d)) for d in shape) or "scalar"


def _shape(text: str) -> tuple:
    return () if text == "scalar" else tuple(int(d) for d in text.split("x"))


@register_host_op("elementwise")
def _elementwise(inputs, attrs):
    """``attrs["op"]`` of HOST_UNARY / HOST_BINARY on the inputs, each viewed as its
    ``attrs["shape<i>"]`` and broadcast as numpy (and ONNX) broadcast; computed in float32,
    returned as ``attrs["out"]``."""
    op = attrs["op"]
    xs = [np.asarray(x, np.float32).reshape(_shape(attrs[f"shape{i}"]))
          for i, x in enumerate(inputs)]
    fn = (HOST_UNARY if len(xs) == 1 else HOST_BINARY)[op][0]
    with np.errstate(all="ignore"):           # inf / nan as the model's own arithmetic gives
        y = fn(*xs)
    return [np.broadcast_to(y, _shape(attrs["out"]))]
