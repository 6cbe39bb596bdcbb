"""Launchers for the dense attention kernels: pick a tile, allocate, launch, return tensors.

Inputs arrive validated (api.py / checks.py): (batch, seqlen, nheads, headdim) with the last
dimension contiguous, one dtype, one device.
"""
from __future__ import annotations

import torch

from . import _runtime, config


def _use_tma(arch: str, *tensors: torch.Tensor) -> bool:
    """TMA needs Hopper, 16-byte aligned bases and 16-byte multiples for every leading stride.
    Forcing it on (tests) lifts the Hopper condition, not the alignment one."""
    forced = config.tma_forced()
    if forced is False or (forced is None and arch != "sm90"):
        return False
    for t in tensors:
        es = t.element_size()
        if t.data_ptr() % 16 or any((s * es) % 16 or s == 0 for s in t.stride()[:-1]):
            return False
    return True


def _flags(q: torch.Tensor, arch: str, *tensors: torch.Tensor) -> dict:
    upcast = arch == "interp" or q.dtype == torch.float32
    use_tma = _use_tma(arch, *tensors)
    if use_tma and arch != "interp":
        _runtime.ensure_tma_allocator()
    return dict(
        USE_TMA=use_tma,
        # the interpreter's bf16 arithmetic is wrong (TRITON-ON-CPU.md): it computes in fp32
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
    )


def _out_dtype(dtype: torch.dtype, arch: str) -> torch.dtype:
    # the interpreter truncates fp32 -> bf16 instead of rounding: it writes fp32 and torch casts
    return torch.float32 if arch == "interp" else dtype


def _bsh(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """out (batch, seqlen_q, nheads, headdim) in q's dtype, lse (batch, nheads, seqlen_q) fp32."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    arch = "interp" if _runtime.interpreted() else config.arch_of(q.device)
    out = _runtime.empty((batch, seqlen_q, nheads, head_dim), _out_dtype(q.dtype, arch), q.device)
    lse = _runtime.empty((batch, nheads, seqlen_q), torch.float32, q.device)
    if out.numel() == 0:
        return out.to(q.dtype), lse
    cfg = config.select("fwd", arch, head_dim, q.dtype, causal)
    grid = (_cdiv(seqlen_q, cfg.block_m) * batch * nheads,)
    _runtime.kernels().fwd.attn_fwd_kernel[grid](
        q, k, v, out, lse,
        *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(out),
        batch, nheads, seqlen_q, seqlen_k, nheads // nheads_k,
        softmax_scale,
        CAUSAL=causal,
        **_flags(q, arch, q, k, v, out),
        HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=_block_d(head_dim),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out.to(q.dtype), lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
             dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
             softmax_scale: float, causal: bool) -> None:
    """Writes dq, dk, dv (any strides with a contiguous last dim; views of one packed tensor are
    fine). `dlse` is the gradient flowing into the returned logsumexp, or None."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    if q.numel() == 0 or k.numel() == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return
    arch = "interp" if _runtime.interpreted() else config.arch_of(q.device)
    K = _runtime.kernels().bwd
    block_d = _block_d(head_dim)

    # delta = rowsum(dO * O) - dlse: the lse gradient enters dS = P * (dP - delta) for free
    delta = _runtime.empty((batch, nheads, seqlen_q), torch.float32, q.device)
    pre_m = 64 if block_d <= 128 else 32
    K.attn_bwd_preprocess_kernel[(_cdiv(seqlen_q, pre_m) * batch * nheads,)](
        out, dout, delta, dlse if dlse is not None else delta,
        *_bsh(out), *_bsh(dout),
        nheads, seqlen_q,
        HAS_DLSE=dlse is not None,
        HEAD_DIM=head_dim,
        BLOCK_M=pre_m,
        BLOCK_D=block_d,
    )

    grads = (dq, dk, dv)
    if arch == "interp":
        grads = tuple(_runtime.empty(g.shape, torch.float32, g.device) for g in grads)
    gq, gk, gv = grads
    flags = _flags(q, arch, q, k, v, dout, gq, gk, gv)
    group = nheads // nheads_k

    cfg = config.select("bwd_dkdv", arch, head_dim, q.dtype, causal)
    K.attn_bwd_dkdv_kernel[(_cdiv(seqlen_k, cfg.block_n) * batch * nheads_k,)](
        q, k, v, dout, lse, delta, gk, gv,
        *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(dout), *_bsh(gk), *_bsh(gv),
        nheads, nheads_k, seqlen_q, seqlen_k, group,
        softmax_scale,
        CAUSAL=causal,
        **flags,
        HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    cfg = config.select("bwd_dq", arch, head_dim, q.dtype, causal)
    K.attn_bwd_dq_kernel[(_cdiv(seqlen_q, cfg.block_m) * batch * nheads,)](
        q, k, v, dout, lse, delta, gq,
        *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(dout), *_bsh(gq),
        batch, nheads, seqlen_q, seqlen_k, group,
        softmax_scale,
        CAUSAL=causal,
        **flags,
        HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if arch == "interp":
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)
