"""W4A16 test weights built from their 4-bit codes, so the reference never unpacks.

The float weight is ``(code - zero) * scale`` computed directly from the codes; the kernel
gets the codes packed as onnxruntime's MatMulNBits defines them: two codes per byte along
K, the even K index in the low nibble; zero points (when given) one per (row, group),
default 8. A nibble-order or group-indexing bug in the NPU's dequantisation cannot agree
with this reference, as it would if both sides unpacked the same bytes the same way."""
import numpy as np


def w4_weights(rng, n: int, k: int, group: int, zeros: bool = False, scale=(0.01, 0.03)):
    """(packed (n, k/2) uint8, scales (n, k/group) fp16, zero points (n, k/group) uint8 or
    None, the float weight (n, k) float32 they encode)."""
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    s = (rng.random((n, k // group)) * (scale[1] - scale[0]) + scale[0]).astype(np.float16)
    z = rng.integers(0, 16, (n, k // group), dtype=np.uint8) if zeros else None
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    per_col = np.arange(k) // group
    zero = z[:, per_col].astype(np.float32) if zeros else np.float32(8)
    weight = (codes.astype(np.float32) - zero) * s[:, per_col].astype(np.float32)
    return packed, s, z, weight
