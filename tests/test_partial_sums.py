"""kernels/partial_sums.py: the column sums of per-program fp32 partials, cast to the parameters' dtype (the
last launch of the norm backward and of the dense GELU' pass). Under Triton's interpreter on CPU, and on
the GPU."""

import pytest
import torch

from flash_backend.kernels.partial_sums import sum_partials
from flash_backend.ops._eager import plain_launch

CASES = [
    (600, 37, True, True, torch.bfloat16),  # several row tiles (BLOCK_P = 256 at 16 columns), masked columns
    (5, 1000, True, False, torch.float32),
    (300, 4100, False, True, torch.float16),  # 32 columns a program
    (44, 3072, False, True, torch.bfloat16),  # the dense GELU' pass at M = 16384, N = 3072 on an H200
    (1, 1, True, True, torch.float32),
]


def _check(programs, n, has_weight, has_bias, dtype, device):
    gen = torch.Generator().manual_seed(programs * 7919 + n)
    partials = [torch.randn(programs, n, generator=gen).to(device) if has else None
                for has in (has_weight, has_bias)]
    outs = [torch.full((n,), float("nan"), dtype=dtype, device=device) if has else None
            for has in (has_weight, has_bias)]
    sum_partials(partials[0], outs[0], partials[1], outs[1], launch=plain_launch)
    for partial, out in zip(partials, outs, strict=True):
        if partial is not None:
            # fp64 reference: the kernel sums in fp32 in its own order, then rounds once to dtype
            expected = partial.double().sum(0)
            torch.testing.assert_close(out.double(), expected, rtol=torch.finfo(dtype).eps * 2,
                                       atol=1e-5 * programs**0.5)


@pytest.mark.interpret
@pytest.mark.parametrize(("programs", "n", "has_weight", "has_bias", "dtype"), CASES)
def test_interpret_sum_partials(interpreter, programs, n, has_weight, has_bias, dtype):
    _check(programs, n, has_weight, has_bias, dtype, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize(("programs", "n", "has_weight", "has_bias", "dtype"), CASES)
def test_cuda_sum_partials(programs, n, has_weight, has_bias, dtype):
    _check(programs, n, has_weight, has_bias, dtype, "cuda")


def test_a_partial_without_its_output_is_refused():
    partial = torch.randn(3, 8)
    with pytest.raises(ValueError, match="each partial needs its output"):
        sum_partials(partial, None, None, None, launch=plain_launch)
