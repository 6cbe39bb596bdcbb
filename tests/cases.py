"""Shapes and options shared by the tests: small on the CPU interpreter, realistic on CUDA."""

import pytest
import torch

from conftest import DEVICE, ON_GPU

DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float32, id="fp32"),
]
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
if ON_GPU:
    SHAPES = [
        (2, 1000, 1500, 8, 2, 59),
        (1, 2048, 1023, 4, 1, 64),
        (4, 1, 1, 4, 4, 16),
        (2, 1, 4096, 8, 8, 128),
        (3, 333, 1, 2, 2, 8),
        (2, 8192, 8192, 4, 4, 128),
        (1, 2049, 2049, 4, 2, 256),
        (2, 1023, 977, 4, 4, 111),
        (1, 1537, 1537, 6, 3, 96),
        (2, 4096, 4096, 8, 1, 64),
        (1, 700, 900, 2, 2, 224),
        (1, 900, 700, 2, 2, 160),
    ]
else:
    SHAPES = [
        (2, 97, 131, 4, 2, 59),
        (1, 131, 97, 2, 1, 64),
        (2, 1, 1, 2, 2, 16),
        (1, 1, 77, 3, 3, 40),
        (1, 77, 1, 2, 2, 8),
        (1, 64, 64, 2, 2, 128),
        (1, 33, 45, 2, 2, 256),
        (1, 50, 50, 4, 1, 111),
        (2, 40, 70, 1, 1, 80),
    ]


def shape_id(shape):
    b, sq, sk, h, hk, d = shape
    return f"b{b}-sq{sq}-sk{sk}-h{h}-hk{hk}-d{d}"


SHAPE_PARAMS = [pytest.param(s, id=shape_id(s)) for s in SHAPES]


def randn(*shape, dtype, requires_grad=False):
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_(requires_grad)


def make_qkv(shape, dtype, requires_grad=True):
    b, sq, sk, h, hk, d = shape
    return (
        randn(b, sq, h, d, dtype=dtype, requires_grad=requires_grad),
        randn(b, sk, hk, d, dtype=dtype, requires_grad=requires_grad),
        randn(b, sk, hk, d, dtype=dtype, requires_grad=requires_grad),
    )


def cu_seqlens(lengths) -> torch.Tensor:
    """cu_seqlens (int32, on the test device) of sequences of these lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
