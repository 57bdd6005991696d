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
