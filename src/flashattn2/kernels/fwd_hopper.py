"""FlashAttention-2 forward for Hopper (sm_90a), written in Gluon (Triton's lower-level dialect).

Same arithmetic as kernels/fwd.py (online softmax in base 2, an unscaled fp32 accumulator divided
by the row sum once at the end, logsumexp stored), but scheduled by hand, which plain Triton 3.6
does not do: Triton waits for each wgmma right after issuing it, so the tensor cores idle while a
warpgroup computes its softmax. Here the QK^T of key block j and the PV of block j-1 are issued
together as asynchronous wgmmas; the softmax of block j runs while PV(j-1) is still on the tensor
cores (FlashAttention-3's intra-warpgroup pipelining). K and V arrive by TMA into STAGES-deep
shared-memory rings, one mbarrier per stage; a stage is refilled as soon as the wgmma that read it
has been waited for.

Two kernels: attn_fwd_ws_kernel (kernels/fwd_hopper_ws.py), warp-specialized: a producer warp loads, two consumer
warpgroups compute one query block each (FlashAttention-3's arrangement); attn_fwd_persist_kernel
(kernels/fwd_hopper_persist.py), the warp-specialized kernel made persistent. The plan takes the persistent kernel
at headdim 64 and 128 and the warp-specialized one at headdim 256. Both run one consumer pipeline
(kernels/fwd_hopper_tile.py's _attn_tile: block 0's QK^T, the steps _attn_step, the last PV) with one layout
preamble (FwdConfig) and one softmax (OnlineSoftmax: every per-score option goes there); they differ only in how a
consumer waits for and releases its key and value blocks (_WsLoads, _PersistLoads: the same four methods) and in
the tiles a program computes (kernels/fwd_hopper_schedule.py). Every partition of both takes the kernel's
arguments, buffers and configuration as aggregates (FwdArgs, WsBuffers or PersistBuffers, FwdConfig). The ring
bookkeeping (stage i % STAGES, phase (i // STAGES) & 1) is kernels/pipeline.py's Ring.

Dense inputs only: descriptors built on the host over (batch, seqlen, heads * headdim) with a
[1, rows, headdim] box, so TMA zero-fills rows past a sequence's end and clips the output's.
Head dims: q/k and v equal (64, 128, 256), or DeepSeek-V3's 192/128. Gluon's tiles are powers of two, so q's
and k's 192 columns are two parts (128 + 64: kernels/pipeline.py's head_dim_parts), each a buffer, a descriptor
(Q and QLo, K and KLo) and a TMA load of its own, and S = Q K^T two chained wgmmas; V, O and the PV product are
v's 128 columns, and O leaves through Q's first part's buffer. (At 192/128, d128's tile with one Q buffer per
consumer fits: Q 48 KB + K 96 + V 64 = 208 KB.)
No softcap, ALiBi, window or dropout (the plan, ops/planning/, sends those to kernels/fwd.py). Causal is
bottom-right aligned (row i sees keys j <= i + seqlen_k - seqlen_q); a query block that sees no key
gets output 0 and logsumexp +inf, as in kernels/fwd.py.
"""

from .fwd_hopper_persist import attn_fwd_persist_kernel
from .fwd_hopper_ws import attn_fwd_ws_kernel

__all__ = ["attn_fwd_persist_kernel", "attn_fwd_ws_kernel"]
