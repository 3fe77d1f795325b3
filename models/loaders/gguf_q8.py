"""GGUF Q8_0 tensors quantized to ``model.quantization`` straight from their int8 blocks.

A Q8_0 row (GGUF's torch layout ``[out, in]``: one output channel) is blocks of 32 int8
values ``q``, each block with one float16 scale ``d``: the weight is ``d * q``. The model
keeps one scale per output channel (``models.quant``), so each row is requantized: its
scale is ``max |d * q|`` over the row over 127 (448 for fp8 e4m3), each value
``d * q / scale`` rounded. ``d * q`` is exact in float32 (11 by 8 significant bits), so
this is ``models.quant.quantize`` of the dequantized matrix, bit for bit, computed a
slab of ``ROWS`` rows at a time from the blocks: no float copy of the whole matrix is
made, and the float peak is one slab. The kernels take one scale per channel, not per
block of 32, hence the requantization: each value moves from ``d * q`` by at most half a
step of its row's scale.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

Q8_0 = gguf.GGMLQuantizationType.Q8_0
BLOCK = 32  # weights per Q8_0 block
_BLOCK_BYTES = 2 + BLOCK  # float16 d, then 32 int8
ROWS = 256  # rows requantized at once
_QMAX = {"int8": 127.0, "fp8": 448.0}


def torch_shape(tensor: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (``[..., out, in]``)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def _blocks(tensor: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(d [rows, blocks] float32, q [rows, blocks, 32] int8)`` views of a Q8_0 tensor's
    bytes, one row per output channel (experts' rows one after another)."""
    shape = torch_shape(tensor)
    cols = shape[-1]
    if cols % BLOCK:
        raise ValueError(f"Q8_0 tensor {tensor.name!r}: rows of {cols} are not whole blocks")
    raw = np.asarray(tensor.data, np.uint8).reshape(-1, cols // BLOCK, _BLOCK_BYTES)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    return d, raw[..., 2:].view(np.int8)


def _requantize_slab(d: np.ndarray, q: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """One slab of rows: (values [rows, in] int8 or e4m3, scales [rows] float32)."""
    w = (q.astype(np.float32) * d[..., None]).reshape(d.shape[0], -1)
    amax = np.max(np.abs(w), axis=-1)
    scale = np.where(amax > 0, amax * np.float32(1.0 / _QMAX[mode]), 1).astype(np.float32)
    scaled = w * (np.float32(1) / scale)[:, None]  # models.quant.quantize's rounding
    if mode == "int8":
        values = np.clip(np.round(scaled), -127, 127).astype(np.int8)
    else:
        import ml_dtypes

        values = np.clip(scaled, -_QMAX[mode], _QMAX[mode]).astype(ml_dtypes.float8_e4m3fn)
    return values, scale


def requantize_q8_0(tensor: Any, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor as per-output-channel ``mode`` (``int8`` | ``fp8``) values in torch
    layout ``[..., out, in]`` and their scales ``[..., out]`` (module docstring)."""
    if tensor.tensor_type != Q8_0:
        raise ValueError(f"{tensor.name!r} is {tensor.tensor_type.name}, not Q8_0")
    shape = torch_shape(tensor)
    d, q = _blocks(tensor)
    slabs = [_requantize_slab(d[i:i + ROWS], q[i:i + ROWS], mode)
             for i in range(0, d.shape[0], ROWS)]
    values = np.concatenate([v for v, _ in slabs]).reshape(shape)
    scales = np.concatenate([s for _, s in slabs]).reshape(shape[:-1])
    return values, scales
