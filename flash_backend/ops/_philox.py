"""Dropout RNG shared by the attention and norm ops: Triton's Philox in plain torch, and p's quantisation.

The kernels draw with Triton's `tl.random.philox` (or `tl.randint4x`, the same function with a 64-bit
counter split into its two low words); `philox_4x32` reproduces it bit for bit in int64 arithmetic, so the
CPU reference, the interpreter and the GPU drop the same elements. Each op lays its counters out its own
way (see its module docstring); what they share is the generator, the round count and how an element's
16-bit random half is compared with p.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: torch.Tensor):
    """(a * b) >> 32 and (a * b) & 0xffffffff for a uint32 constant a and a uint32-valued int64 tensor b."""
    ah, al = a >> 16, a & 0xFFFF
    t_hi = ah * b  # < 2**48
    t_lo = al * b  # < 2**48
    hi = (t_hi + (t_lo >> 16)) >> 16
    lo = (((t_hi & 0xFFFF) << 16) + t_lo) & _M32
    return hi, lo


def philox_4x32(seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, rounds: int = 10):
    """Triton's tl.random.philox(seed, c0, c1, 0, 0, n_rounds=rounds): its 4 uint32 words, in int64."""
    seed = seed.reshape(()).to(torch.int64)
    k0 = seed & _M32
    k1 = (seed >> 32) & _M32
    c0 = c0.to(torch.int64) & _M32
    c1 = c1.to(torch.int64) & _M32
    c0, c1 = torch.broadcast_tensors(c0, c1)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo32(0xCD9E8D57, c2)
        hi_a, lo_a = _mulhilo32(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


# Philox4x32-7, as FlashAttention's dropout: Random123 (Salmon et al., SC'11) found 7 rounds the fewest that
# pass BigCrush (10 is their default, with margin). 7 made our attention dropout forward ~10% faster on an
# H200. The kernels pass it as a literal (n_rounds must be a compile-time constant).
DROPOUT_PHILOX_ROUNDS = 7
HALF = 1 << 16  # one random 32-bit word serves two elements, 16 bits each


def dropout_threshold(dropout_p: float) -> int:
    """p quantised to 1/65536: an element is dropped when its 16-bit random half is below this."""
    return min(max(int(round(dropout_p * HALF)), 0), HALF - 1)


def dropout_scale(dropout_p: float) -> float:
    """1 / P(keep) of the quantised p, so that E[keep * scale] = 1: rounding p to 1/65536 adds no bias."""
    return HALF / (HALF - dropout_threshold(dropout_p))
