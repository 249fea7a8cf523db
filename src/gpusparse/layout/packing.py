"""Sparse postings of the tiled layout in 5 bytes: a 32-bit word and a byte, exactly.

A sparse posting of a float32 layout is an offset inside its tile (``tile_bits`` bits) and a
float32 weight. The weights are positive, finite and normal, and their binary exponents
span few values, so a weight's bits are its 23-bit mantissa and an exponent relative to the
layout's smallest one, ``exp_base``, in ``17 - tile_bits`` bits (at most 8): at the default
8,192-document tiles 4 bits, 16 exponents (the calibrated generator's clamp to
``[1e-4, 3.5]`` spans 16; splade-tiny's unpruned output 19 to 21, which needs tiles of 4,096
documents or fewer, or pruning below ~1e-4). The posting's 40 bits are

* ``word`` (uint32, stored as int32): ``offset << (32 - tile_bits) | field >> 8``, the offset
  in the top bits so that ``word < offset << (32 - tile_bits)`` orders postings by offset
  (rescoring's binary search reads the words alone);
* ``low`` (uint8): ``field & 0xFF``;

with ``field = bits(w) - (exp_base << 23)``. Unpacking adds ``exp_base << 23`` back: the
same float32 bits, so every kernel computes what it did from the 6-byte form. With
fixed-point products the kernel adds ``(exp_base + weight_bits) << 23`` instead, which is
``w · 2**weight_bits`` exactly (a normal float's exponent shifted within the normal range),
and rounds it to the integer as before. Layouts whose weights do not fit (a wider exponent
span, a denormal weight, 8-bit levels or stored integers) keep the 6-byte form
(:func:`exponent_base` says which).
"""

from __future__ import annotations

import torch

MANTISSA_BITS = 23
EXP_NORMAL = (1, 254)  # exponent fields of normal finite float32 numbers


def exp_bits(tile_bits: int) -> int:
    """Bits of the relative exponent beside ``tile_bits`` of offset (40 bits in all)."""
    return min(8, 17 - tile_bits)


def word_shift(tile_bits: int) -> int:
    """The offset's place in the word."""
    return 32 - tile_bits


def exponent_range(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(smallest, largest)`` exponent field of float32 ``scores`` (0-dim int64 tensors, on
    their device, no host sync; a negative weight gives a negative field, a denormal or zero
    0, NaN or infinity 255: all outside :data:`EXP_NORMAL`). Empty: ``(255, 0)``, which
    :func:`merge_range` leaves neutral."""
    if scores.numel() == 0:
        return torch.tensor(255, device=scores.device), torch.tensor(0, device=scores.device)
    e = (scores.contiguous().view(torch.int32) >> MANTISSA_BITS).to(torch.int64)  # arithmetic: sign → negative
    return e.min(), e.max()


def merge_range(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    """The range covering two :func:`exponent_range` results."""
    return torch.minimum(a[0], b[0]), torch.maximum(a[1], b[1])


def exponent_base(lo: int, hi: int, tile_bits: int, weight_bits: int | None = None) -> int | None:
    """The ``exp_base`` of weights whose exponent fields span ``[lo, hi]`` in tiles of
    ``2**tile_bits`` documents (``weight_bits``: their fixed-point scaling, which must keep
    every ``w · 2**weight_bits`` normal), or ``None`` when they cannot be packed (see the
    module docstring). No weights at all (``lo > hi``): packed, base 127."""
    if lo > hi:
        return 127
    if lo < EXP_NORMAL[0] or hi > EXP_NORMAL[1] or hi - lo >= 1 << exp_bits(tile_bits):
        return None
    if weight_bits is not None and not (EXP_NORMAL[0] <= lo + weight_bits and hi + weight_bits <= EXP_NORMAL[1]):
        return None
    return lo


def pack(
    offsets: torch.Tensor, weights: torch.Tensor, exp_base: int, tile_bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(word int32, low uint8)`` of postings with integer ``offsets`` (< 2**tile_bits) and
    float32 ``weights`` whose exponents lie in the range :func:`exponent_base` accepted (not
    checked here)."""
    field = weights.contiguous().view(torch.int32).to(torch.int64) - (exp_base << MANTISSA_BITS)
    word = (offsets.to(torch.int64) << word_shift(tile_bits)) | (field >> 8)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)  # uint32 bits in an int32
    return word.to(torch.int32), (field & 0xFF).to(torch.uint8)


def unpack_offsets(word: torch.Tensor, tile_bits: int) -> torch.Tensor:
    """int64 offsets of packed words."""
    return (word.to(torch.int64) & 0xFFFFFFFF) >> word_shift(tile_bits)


def unpack_weights(word: torch.Tensor, low: torch.Tensor, exp_base: int, tile_bits: int) -> torch.Tensor:
    """float32 weights of packed postings: the bits they were packed from."""
    field = ((word.to(torch.int64) & ((1 << word_shift(tile_bits)) - 1)) << 8) | low.to(torch.int64)
    return (field + (exp_base << MANTISSA_BITS)).to(torch.int32).view(torch.float32)


def kernel_bias(exp_base: int, weight_bits: int | None) -> int:
    """What the kernels add to a posting's field: ``exp_base << 23`` (the float32 bits), or
    with fixed-point products ``(exp_base + weight_bits) << 23`` (the bits of ``w ·
    2**weight_bits``, exact: :func:`exponent_base` kept them normal; checked again here)."""
    e = exp_base + (weight_bits or 0)
    if not EXP_NORMAL[0] <= e <= EXP_NORMAL[1]:
        raise ValueError(f"weights times 2**{weight_bits} leave float32's normal range (exponent base {exp_base})")
    return e << MANTISSA_BITS
