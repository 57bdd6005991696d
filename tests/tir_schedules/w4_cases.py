"""W4A16 test weights built from their 4-bit codes, so the reference never unpacks.

The float weight is ``(code - zero) * scale`` computed directly from the codes; the kernel
gets the codes packed as onnxruntime's MatMulNBits defines them: two codes per byte along
K, the even K index in the low nibble; zero points (when given) one per (row, group),
default 8. A nibble-order or group-indexing bug in the NPU's dequantisation cannot agree
with this reference, as it would if both sides unpacked the same bytes the same way."""
import numpy as np


def w4_weights(rng, n: int, k: int, group: int, zeros: str = "none", scale=(0.01, 0.03)):
    """(packed (n, k/2) uint8, scales (n, k/group) fp16, zero points (n, k/group) or None,
    the float weight (n, k) float32 they encode).

    ``zeros``: "none" (zero point 8), "uint8" (integer zero points in [0, 15]) or
    "float16" (float zero points anywhere in [-4, 20), as MatMulNBits' float form allows;
    fractional, so a kernel that rounded or truncated them would not agree)."""
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    s = (rng.random((n, k // group)) * (scale[1] - scale[0]) + scale[0]).astype(np.float16)
    if zeros == "uint8":
        z = rng.integers(0, 16, (n, k // group), dtype=np.uint8)
    elif zeros == "float16":
        z = (rng.random((n, k // group)) * 24 - 4).astype(np.float16)
    elif zeros == "none":
        z = None
    else:
        raise ValueError(f"zeros={zeros!r}")
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    per_col = np.arange(k) // group
    zero = z[:, per_col].astype(np.float32) if z is not None else np.float32(8)
    weight = (codes.astype(np.float32) - zero) * s[:, per_col].astype(np.float32)
    return packed, s, z, weight
