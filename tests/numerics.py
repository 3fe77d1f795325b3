"""Floating-point bounds derived from the computation, not from one CPU.

XLA:CPU picks its kernels (YNNPACK, Eigen, LLVM-emitted loops), their vector widths and
their tiling per CPU model and instruction set, so the same float32 program sums in a
different order on another machine; PyTorch sums in yet another. Rounding a length-``n``
sum errs by up to ``n * eps`` times its terms' magnitude, typically ``sqrt(n) * eps``
(rounding errors add like a random walk), and two summation orders differ by about as
much; ``depth`` chained blocks add their errors the same way. Hence one bound for every
float32 comparison of the suite::

    tol = K_F32 * eps * sqrt(reduction_len * depth) * scale

``scale`` is the magnitude of the compared values (``max |reference|``, or of the values
a weighted sum combines), ``reduction_len`` the longest reduction on the way (hidden
size, FFN size, head dim, context length), ``depth`` the number of chained blocks
(layers, plus one for the output head). The bound is absolute, with no ``rtol``: a dot
product's error scales with its terms, not with its result, so an output that cancels
to near zero (the 0.0192 logit of the issue) errs as much as the largest one.

``K_F32 = 8`` is the safety factor over the typical growth. Across instruction sets and
kernel libraries (``XLA_FLAGS=--xla_cpu_max_isa=AVX2|AVX|SSE4_2``, YNNPACK on and off)
the differences seen stay under a quarter of the bound, while the bugs these tests exist
for (wrong RoPE, a missing bias, a page off by one) move logits and attention outputs by
far more than it.

bfloat16 keeps 8 significant bits: ``BF16_EPS = 2**-7`` is its spacing at 1.0, and one
rounding moves a value by at most ``BF16_EPS / 2`` relative to itself.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

F32_EPS = float(np.finfo(np.float32).eps)  # 2**-23
BF16_EPS = 2.0**-7  # spacing of bfloat16 at 1.0; unit roundoff is BF16_EPS / 2
K_F32 = 8.0  # safety factor over eps * sqrt(n): see the module docstring


def magnitude(x: ArrayLike) -> float:
    """``max |x|`` in float64 (the ``scale`` of a bound)."""
    return float(np.max(np.abs(np.asarray(x, np.float64))))


def f32_tolerance(scale: ArrayLike, reduction_len: int, *, depth: int = 1,
                  k: float = K_F32) -> float:
    """``k * eps_f32 * sqrt(reduction_len * depth) * max |scale|``.

    ``scale`` is an array (its largest magnitude is used) or a number; ``reduction_len``
    is the longest sum a compared value went through, ``depth`` the number of chained
    blocks whose rounding errors add up.
    """
    if reduction_len < 1 or depth < 1:
        raise ValueError(f"reduction_len and depth must be >= 1, got {reduction_len}, {depth}")
    return k * F32_EPS * math.sqrt(reduction_len * depth) * magnitude(scale)


class DecoderShape(Protocol):
    """The fields of ``models.config.ModelConfig`` a logits bound needs."""

    hidden_size: int
    intermediate_size: int
    head_dim: int
    num_layers: int


def logits_tolerance(config: DecoderShape, reference: ArrayLike, context_len: int, *,
                     k: float = K_F32) -> float:
    """Bound for float32 logits of a Llama-family decoder computed two ways.

    The longest reduction is the FFN's down projection, the hidden size (projections,
    RMSNorm, lm_head), the head dim (scores) or the context (attention's weighted sum),
    whichever is longest; every layer adds its error, and the lm_head one more; the scale
    is the largest reference logit.
    """
    n = max(config.hidden_size, config.intermediate_size, config.head_dim, context_len)
    return f32_tolerance(reference, n, depth=config.num_layers + 1, k=k)


def attention_tolerance(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float,
                        context_len: int, dtype: str = "float32",
                        out: ArrayLike | None = None, k_f32: float = K_F32) -> float:
    """Bound for ``softmax(scale * q k^T) v`` computed two ways (other key tiles, other
    online-softmax steps, other kernels). ``q``, ``k``, ``v``: [..., head_dim]; ``k`` and
    ``v`` may hold more keys than are attended (a whole pool): that only widens the bound.

    float32: the weighted sum of ``context_len`` values errs by about
    ``eps * sqrt(context_len) * max|v|``; a score sums ``head_dim`` products, so it errs by
    about ``eps * sqrt(head_dim) * max|s|``, and a score error ``ds`` moves the output, a
    convex combination of ``v``, by about ``ds * max|v|``. Times ``k_f32``.

    bfloat16 (``dtype``) adds worst-case roundings, no safety factor needed: the Pallas
    kernel rounds the probabilities to bfloat16 before ``p @ v`` (relative error
    <= BF16_EPS / 2 each, so at most ``BF16_EPS / 2 * max|v|`` on the combination), and
    both sides round their output to bfloat16, possibly to neighbouring values: one
    spacing, at most ``BF16_EPS * max|out|``.
    """
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    head_dim = q64.shape[-1]
    s_max = abs(scale) * magnitude(q64.reshape(-1, head_dim) @ k64.reshape(-1, head_dim).T)
    v_max = magnitude(v64)
    tol = k_f32 * F32_EPS * v_max * (math.sqrt(max(context_len, 1))
                                     + math.sqrt(head_dim) * s_max)
    if dtype == "bfloat16":
        out_max = v_max if out is None else magnitude(out)
        tol += BF16_EPS / 2 * v_max + BF16_EPS * out_max
    elif dtype != "float32":
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    return tol


def max_abs_diff(actual: ArrayLike, desired: ArrayLike) -> float:
    """``max |actual - desired|`` in float64; same shapes and a finite ``actual`` required."""
    a = np.asarray(actual, np.float64)
    d = np.asarray(desired, np.float64)
    if a.shape != d.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {d.shape}")
    if not np.isfinite(a).all():
        raise AssertionError("actual holds non-finite values")
    return float(np.max(np.abs(a - d))) if a.size else 0.0


def assert_close(actual: ArrayLike, desired: ArrayLike, tol: float, what: str = "") -> float:
    """Every ``|actual - desired| <= tol`` (absolute). Prints the margin (shown by ``-s``
    or ``-rP``) and returns the largest difference."""
    diff = max_abs_diff(actual, desired)
    print(f"[numerics] {what}: max|diff| {diff:.3e}, bound {tol:.3e} "
          f"({diff / tol:.1%} of it)")
    if not diff <= tol:
        a = np.asarray(actual, np.float64)
        d = np.asarray(desired, np.float64)
        idx = np.unravel_index(int(np.argmax(np.abs(a - d))), a.shape)
        raise AssertionError(
            f"{what}: max |actual - desired| {diff:.3e} > bound {tol:.3e} "
            f"(at {tuple(int(i) for i in idx)}: {a[idx]!r} vs {d[idx]!r})")
    return diff


def top1_disagreements(actual: ArrayLike, desired: ArrayLike, tol: float
                       ) -> tuple[list[list[int]], float]:
    """Rows (indices) whose argmax over the last axis differs although the reference's
    top-1 leads its top-2 by more than ``2 * tol`` (closer ties may legitimately flip
    within the bound), and the fraction of rows with such a lead."""
    a = np.asarray(actual, np.float64)
    d = np.asarray(desired, np.float64)
    top2 = np.sort(d, axis=-1)[..., -2:]
    decided = top2[..., 1] - top2[..., 0] > 2 * tol
    bad = np.argwhere(decided & (a.argmax(-1) != d.argmax(-1)))
    return bad.tolist(), float(decided.mean())


def assert_same_top1(actual: ArrayLike, desired: ArrayLike, tol: float, what: str = "",
                     min_decided: float = 0.5) -> None:
    """The same top-1 token wherever the reference decides it beyond ``2 * tol``, and that
    in at least ``min_decided`` of the rows (so the check cannot pass vacuously)."""
    bad, decided = top1_disagreements(actual, desired, tol)
    assert not bad, f"{what}: top-1 differs at rows {bad[:5]} (reference lead > {2 * tol:.2e})"
    assert decided >= min_decided, f"{what}: only {decided:.0%} of rows have a clear top-1"
