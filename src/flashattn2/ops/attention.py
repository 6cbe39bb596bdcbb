"""Launchers for the dense attention kernels: pick a tile, allocate, launch, return tensors.

Inputs arrive validated (api.py / checks.py): (batch, seqlen, nheads, headdim) with the last
dimension contiguous, one dtype, one device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _runtime, config


@dataclass(frozen=True)
class ScoreMods:
    """How scores are formed and masked, resolved from flash_attn's arguments.

    causal=True sets the window's right edge to 0 (flash_attn's rule); a window that is only
    that becomes the CAUSAL path, any other finite edge the LOCAL path, where an unbounded edge
    is replaced by one that cannot bind (seqlen_q + seqlen_k).
    """
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None

    def kernel_args(self, seqlen_q: int, seqlen_k: int, like: torch.Tensor):
        """(pointer/runtime arguments, constexpr flags) for the kernels."""
        left, right = self.window_left, 0 if self.causal else self.window_right
        causal = left < 0 and right == 0
        local = not causal and (left >= 0 or right >= 0)
        far = seqlen_q + seqlen_k
        alibi = self.alibi_slopes
        runtime = dict(
            Alibi=alibi if alibi is not None else like,
            stride_alibi_b=alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0,
            window_left=left if left >= 0 else far,
            window_right=right if right >= 0 else far,
            softcap=self.softcap if self.softcap > 0 else 1.0,
        )
        flags = dict(CAUSAL=causal, LOCAL=local, SOFTCAP=self.softcap > 0, ALIBI=alibi is not None)
        return runtime, flags


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
            mods: ScoreMods) -> tuple[torch.Tensor, torch.Tensor]:
    """out (batch, seqlen_q, nheads, headdim) in q's dtype, lse (batch, nheads, seqlen_q) fp32."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    arch = "interp" if _runtime.interpreted() else config.arch_of(q.device)
    out = _runtime.empty((batch, seqlen_q, nheads, head_dim), _out_dtype(q.dtype, arch), q.device)
    lse = _runtime.empty((batch, nheads, seqlen_q), torch.float32, q.device)
    if out.numel() == 0:
        return out.to(q.dtype), lse
    runtime, flags = mods.kernel_args(seqlen_q, seqlen_k, lse)
    cfg = config.select("fwd", arch, head_dim, q.dtype, flags["CAUSAL"])
    grid = (_cdiv(seqlen_q, cfg.block_m) * batch * nheads,)
    _runtime.kernels().fwd.attn_fwd_kernel[grid](
        q, k, v, out, lse, runtime["Alibi"],
        *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(out),
        runtime["stride_alibi_b"],
        batch, nheads, seqlen_q, seqlen_k, nheads // nheads_k, runtime["window_left"], runtime["window_right"],
        softmax_scale, runtime["softcap"],
        **flags,
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
             softmax_scale: float, mods: ScoreMods) -> None:
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
    runtime, mod_flags = mods.kernel_args(seqlen_q, seqlen_k, lse)
    causal = mod_flags["CAUSAL"]

    cfg = config.select("bwd_dkdv", arch, head_dim, q.dtype, causal)
    K.attn_bwd_dkdv_kernel[(_cdiv(seqlen_k, cfg.block_n) * batch * nheads_k,)](
        q, k, v, dout, lse, delta, gk, gv, runtime["Alibi"],
        *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(dout), *_bsh(gk), *_bsh(gv),
        runtime["stride_alibi_b"],
        nheads, nheads_k, seqlen_q, seqlen_k, group, runtime["window_left"], runtime["window_right"],
        softmax_scale, runtime["softcap"],
        **mod_flags,
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
        q, k, v, dout, lse, delta, gq, runtime["Alibi"],
        *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(dout), *_bsh(gq),
        runtime["stride_alibi_b"],
        batch, nheads, seqlen_q, seqlen_k, group, runtime["window_left"], runtime["window_right"],
        softmax_scale, runtime["softcap"],
        **mod_flags,
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
