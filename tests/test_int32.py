"""Index arithmetic at int32's edge (docs/design.md, "Index arithmetic and int32"): lengths past which the kernels'
int32 position sums would wrap are refused (checks.MAX_POSITIONS) and lengths up to it run; a product of an index
and a stride past 2**31 elements, or a position past 2**31, is int64; plans keep TMA's int32 coordinates in range.
Huge strides and lengths over little memory: views of a sparse file mapping on the CPU (only the pages written are
allocated), rows that overlap (a row stride of one element), meta tensors for the plans."""

import importlib

import pytest
import torch

import flashattn2
from cases import cu_seqlens, randn
from conftest import DEVICE, ON_GPU
from flashattn2.layers.rotary import apply_rotary_emb, apply_rotary_emb_torch
from flashattn2.ops.request import checks
from flashattn2.ops import planning
from flashattn2.ops.run import registry
from flashattn2.ops.request import spec as specs
from flashattn2.ops.launch.layout import BackwardTensors
from flashattn2.ops.request.options import Options
from flashattn2.ops.request.request import AttentionRequest, KVCacheRequest
from flashattn2.reference import attention_ref

# on a GPU each test allocates up to 8 GiB (huge): the GPU suite runs them apart, serially
pytestmark = pytest.mark.big_memory

L = checks.MAX_POSITIONS


def huge(tmp_path, numel: int, dtype) -> torch.Tensor:
    """A 1-D tensor of numel elements that costs only the memory written: a sparse file's shared mapping on the CPU
    (not charged to the process's memory); on a GPU an allocation, up to 8 GiB."""
    if ON_GPU and numel * dtype.itemsize > 8 << 30:
        pytest.skip("a GPU's memory is real: this buffer would starve the tests beside it")
    try:
        if ON_GPU:
            return torch.empty(numel, dtype=dtype, device=DEVICE)
        tmp_path.mkdir(parents=True, exist_ok=True)
        path = tmp_path / "huge.bin"
        with open(path, "wb") as f:
            f.truncate(numel * dtype.itemsize)
        t = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        path.unlink()  # (the mapping stays: nothing is left on disk once the tensor is gone)
        return t
    except (OSError, RuntimeError) as e:  # (a file system without sparse files, a GPU without the memory)
        pytest.skip(f"no {numel}-element buffer here: {e}")


def overlapping(tmp_path, rows: int, d: int, dtype=torch.float32) -> torch.Tensor:
    """(1, rows, 1, d) whose row r is elements r .. r + d - 1 of one buffer: `rows` positions in rows + d elements."""
    return huge(tmp_path, rows + d, dtype).as_strided((1, rows, 1, d), (d, 1, d, 1))


def test_rotary_heads_far_apart(tmp_path):
    """apply_rotary_emb on a head-major view whose last head starts 2**31 elements past its first: the kernel added
    h * stride_h in int32, so head 8 was read and written 2**31 elements before its place (here still inside the
    buffer: a wrong result rather than a fault)."""
    nheads, d, stride_h, offset = 9, 8, 2**28, 2**31
    x = huge(tmp_path, offset + nheads * stride_h, torch.float32).as_strided(
        (1, 3, nheads, d), (3 * d, d, stride_h, 1), offset
    )
    x.copy_(randn(1, 3, nheads, d, dtype=torch.float32))
    cos, sin = randn(5, d // 2, dtype=torch.float32), randn(5, d // 2, dtype=torch.float32)
    want = apply_rotary_emb_torch(x.clone(), cos[:3], sin[:3])
    apply_rotary_emb(x, cos, sin, inplace=True)
    torch.testing.assert_close(x, want)


def test_rotary_positions_past_int32(tmp_path):
    """A rotary table of more than 2**31 positions and an offset near 2**31: a token's position (row + offset)
    passes 2**31, and the kernel took it in int32 (wrapped negative: the token was left unrotated)."""
    n, offset, seqlen = 2**31 + 16, 2**31 - 8, 16
    table = huge(tmp_path, 2 * n, torch.float32)
    cos, sin = table[:n].view(n, 1), table[n:].view(n, 1)
    angles = torch.rand(seqlen, 1, device=DEVICE) * 6
    cos[offset : offset + seqlen], sin[offset : offset + seqlen] = angles.cos(), angles.sin()
    x = randn(1, seqlen, 2, 2, dtype=torch.float32)
    want = apply_rotary_emb_torch(x, cos[offset : offset + seqlen], sin[offset : offset + seqlen])
    torch.testing.assert_close(apply_rotary_emb(x, cos, sin, seqlen_offsets=offset), want)


def test_rotary_sequences_past_the_grids_second_axis(monkeypatch):
    """A varlen batch of more than 65535 sequences: CUDA caps a grid's second and third axes at 65535, and the rotary
    kernel had one sequence per program on its second axis (the launch failed). The sequences fill the second axis
    and go on in the third (here with rows of 2 to run it in the interpreter: 5 sequences, the last program past
    them)."""
    from flashattn2.ops.launch import rotary as ops_rotary

    grids = []
    monkeypatch.setattr(ops_rotary.launcher, "launch", lambda kernel, grid, *args, **kw: grids.append(grid))
    x, cos = randn(70000, 1, 2, dtype=torch.float32), randn(1, 1, dtype=torch.float32)
    ops_rotary.rotate_(x, cos, cos, False, cu_seqlens=cu_seqlens([1] * 70000), max_seqlen=1)
    (grid,) = grids
    assert max(grid[1:]) <= 65535 and grid[1] * grid[2] >= 70000, grid
    monkeypatch.undo()
    monkeypatch.setattr(ops_rotary, "_GRID_YZ", 2)
    lengths = [3, 1, 4, 1, 5]
    x = randn(sum(lengths), 2, 8, dtype=torch.float32)
    cos, sin = randn(5, 4, dtype=torch.float32), randn(5, 4, dtype=torch.float32)
    want = torch.cat([apply_rotary_emb_torch(t[None], cos[: len(t)], sin[: len(t)])[0] for t in x.split(lengths)])
    out = apply_rotary_emb(x, cos, sin, cu_seqlens=cu_seqlens(lengths), max_seqlen=5)
    torch.testing.assert_close(out, want)


def test_attention_heads_far_apart(tmp_path):
    """q, k, v and dO head-major views whose last head starts 2**31 elements past their first: the forward, the
    backward and the batch-invariant mode's forward (the decode kernel) take each head's offset in int64."""
    nheads, d, stride_h, offset, seqlen = 9, 8, 2**28, 2**31, 5
    buf = huge(tmp_path, offset + nheads * stride_h, torch.float32)
    q, k, v, do = (
        buf.as_strided((1, seqlen, nheads, d), (seqlen * d, d, stride_h, 1), offset + i * seqlen * d) for i in range(4)
    )
    for t in (q, k, v, do):
        t.copy_(randn(1, seqlen, nheads, d, dtype=torch.float32))
    dense = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention_ref(*dense, causal=True)[0]
    want_grads = torch.autograd.grad(want, dense, do)
    options = Options(softmax_scale=d**-0.5, causal=True)
    out, lse = registry.forward(q, k, v, options)
    torch.testing.assert_close(out, want.to(out.dtype))
    grads = [torch.empty(1, seqlen, nheads, d, device=DEVICE) for _ in range(3)]
    registry.backward(BackwardTensors(do, q, k, v, out, lse, None, *grads), options, True)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref.to(got.dtype))
    with flashattn2.batch_invariant():
        torch.testing.assert_close(registry.forward(q, k, v, options)[0], out)


@pytest.mark.parametrize("path", ["dense", "varlen", "invariant"])
def test_literal_window_edges_near_int32(path):
    """Options keep their window edges literally (the ops, the ring's blocks): an edge near 2**31 binds no more than
    the kernels' own unbounded edge, seqlen_q + seqlen_k, and runs as it does, bit for bit (it was taken as given, and
    row + diagonal + edge wrapped: outputs 0, LSE +inf, gradients 0)."""
    sq, sk, h, d = 13, 19, 2, 16
    q, do = (randn(2, sq, h, d, dtype=torch.float16) for _ in range(2))
    k, v = (randn(2, sk, h, d, dtype=torch.float16) for _ in range(2))
    lengths = {}
    if path == "varlen":
        lengths = dict(cu_seqlens_q=cu_seqlens([sq, sq - 3]), cu_seqlens_k=cu_seqlens([sk, sk - 5]))
        lengths.update(max_seqlen_q=sq, max_seqlen_k=sk)
        q, k, v, do = (torch.cat([t[0], t[1, : t.shape[1] - (3 if t.shape[1] == sq else 5)]]) for t in (q, k, v, do))

    def run(left, right):
        options = Options(**lengths, softmax_scale=d**-0.5, window_left=left, window_right=right)
        with flashattn2.batch_invariant(path == "invariant"):
            out, lse = registry.forward(q, k, v, options)
        if path == "invariant":
            return out, lse
        grads = [torch.empty_like(t) for t in (q, k, v)]
        registry.backward(BackwardTensors(do, q, k, v, out, lse, None, *grads), options, True)
        return out, lse, *grads

    far = sq + sk
    for edges, literal in [((3, 2**31 - 1), (3, far)), ((2**31 - 2, 2), (far, 2))]:
        got, want = run(*edges), run(*literal)
        assert want[0].abs().amax() > 0 and not want[0].isnan().any()
        for a, b in zip(got, want):
            assert torch.equal(a, b), edges


def test_dense_lengths_past_max_positions_are_refused(tmp_path):
    """seqlen_k past 2**29 raises NotImplementedError naming it; at 2**31 - 1 (an int32 still) the causal diagonal
    plus a block wrapped and the output was zeros. seqlen_q likewise."""
    q = randn(1, 1, 1, 8, dtype=torch.float32)
    for n in (L + 1, 2**31 - 1):
        k = overlapping(tmp_path, n, 8)
        with pytest.raises(NotImplementedError, match=rf"seqlen_k is {n}: .* 2\*\*29"):
            flashattn2.flash_attn_func(q, k, k, window_size=(4, 0))
        with pytest.raises(NotImplementedError, match=rf"seqlen_q is {n}: .* 2\*\*29"):
            flashattn2.flash_attn_func(k, q, q)


def test_dense_keys_at_max_positions(tmp_path):
    """2**29 keys run: a query that sees the last five (a window) against attention over those five alone."""
    q = randn(1, 1, 1, 8, dtype=torch.float32)
    k = overlapping(tmp_path, L, 8)
    last = k[:, L - 5 :]
    k.as_strided((L - 5 + 12,), (1,))[L - 5 :].copy_(randn(12, dtype=torch.float32))  # the last five rows' elements
    out = flashattn2.flash_attn_func(q, k, k, window_size=(4, 0))
    torch.testing.assert_close(out, attention_ref(q, last, last)[0].to(out.dtype))


def test_varlen_lengths_past_max_positions_are_refused(tmp_path):
    """max_seqlen_q/k and a pack's rows past 2**29 raise NotImplementedError naming them; with a max_seqlen_k of
    2**31 - 8 (an int32 still) the kernels' unbounded edge, max_seqlen_q + max_seqlen_k, wrapped their sums: zeros."""
    q = randn(5, 1, 8, dtype=torch.float32)
    cu = cu_seqlens([2, 3])
    for max_k in (L + 1, 2**31 - 8):
        with pytest.raises(NotImplementedError, match=rf"max_seqlen_k is {max_k}: .* 2\*\*29"):
            flashattn2.flash_attn_varlen_func(q, q, q, cu, cu, 3, max_k, window_size=(4, -1))
    with pytest.raises(NotImplementedError, match=r"max_seqlen_q is .* 2\*\*29"):
        flashattn2.flash_attn_varlen_func(q, q, q, cu, cu, L + 1, 3)
    k = overlapping(tmp_path, L + 1, 8)[0]
    with pytest.raises(NotImplementedError, match=rf"total_k is {L + 1}: .* 2\*\*29"):
        flashattn2.flash_attn_varlen_func(q, k, k, cu, cu, 3, 3)
    with pytest.raises(NotImplementedError, match=rf"total_q is {L + 1}: .* 2\*\*29"):
        flashattn2.flash_attn_varlen_func(k, q, q, cu, cu, 3, 3)


def test_kvcache_capacity_past_max_positions_is_refused(tmp_path):
    """A cache of more than 2**29 positions raises NotImplementedError naming its capacity: a block table of 2**15
    pages of 2**16 rows (one page in memory) is 2**31 positions, where cache_seqlens + seqlen_new wrapped in int32
    (the keys' end negative: output 0). A contiguous cache's seqlen, q's seqlen likewise."""
    k_cache = randn(1, 2**16, 1, 8, dtype=torch.float32)
    table = torch.zeros(1, 2**15, dtype=torch.int32, device=DEVICE)
    q, k = randn(1, 2, 1, 8, dtype=torch.float32), randn(1, 2, 1, 8, dtype=torch.float32)
    with pytest.raises(
        NotImplementedError, match=r"capacity block_table.shape\[1\] \* k_cache.shape\[1\] is 2147483648"
    ):
        flashattn2.flash_attn_with_kvcache(
            q, k_cache, k_cache, k, k, cache_seqlens=2**31 - 2, block_table=table, causal=True, window_size=(4, 0)
        )
    big = overlapping(tmp_path, L + 1, 8)
    with pytest.raises(NotImplementedError, match=rf"k_cache.shape\[1\] is {L + 1}: .* 2\*\*29"):
        flashattn2.flash_attn_with_kvcache(q, big, big, cache_seqlens=3)
    with pytest.raises(NotImplementedError, match=rf"seqlen_q is {L + 1}: .* 2\*\*29"):
        flashattn2.flash_attn_with_kvcache(big, k_cache, k_cache, cache_seqlens=3)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_varlen_packed_rows_past_int32_are_refused():
    """The KV-cache kernel counts a varlen q's packed rows (query heads per K/V head x max_seqlen_q) in int32: the
    paged prefill and the batch-invariant mode's varlen call refuse 2**31 of them (4 heads x 2**29 queries), and plan
    2**31 - 4."""
    cu = _meta(3, dtype=torch.int32)
    k = _meta(4, 16, 1, 64)
    table = _meta(2, 4, dtype=torch.int32)
    q = _meta(8, 4, 64)
    for max_q, ok in ((L, False), (L - 1, True)):
        paged = specs.paged(AttentionRequest(q, k, k, cu, cu, max_q, 64, block_table=table))
        attention = specs.attention(AttentionRequest(q, k[0], k[0], cu, cu, max_q, 16, deterministic=True))
        invariant = attention._replace(modes=attention.modes._replace(invariant=True, arch="sm90"))
        for spec in (paged._replace(modes=paged.modes._replace(arch="sm90")), invariant):
            if ok:
                assert planning.plan(spec).kernel == "decode"
            else:
                with pytest.raises(NotImplementedError, match="2147483648 packed rows"):
                    planning.plan(spec)


def test_tma_columns_within_int32():
    """A (batch, seqlen, heads * headdim) descriptor's column coordinate is int32: the Gluon kernels and the host-built
    descriptors take nheads * headdim below 2**31 only (2**23 heads of 256: the Triton kernels with pointers)."""
    explain = importlib.import_module("flashattn2.explain")
    token = checks.META_OK.set(True)
    try:
        plans = []
        for nheads, ok in ((2**23 - 1, True), (2**23, False)):
            q = _meta(1, 128, nheads, 256)
            spec = explain._on("sm90", explain._attention_spec(q, q, q, {"causal": True}))
            with planning.force(hopper=False):
                triton_plan = planning.plan(spec._replace(modes=spec.modes._replace(forced=planning.forced())))
            assert triton_plan.host_desc is ok, nheads
            plans.append((nheads, ok, planning.plan(spec)))
        if not plans[0][2].gluon:
            pytest.skip("the Gluon kernels do not run on this Triton release")
        for nheads, ok, plan in plans:
            assert plan.gluon is ok, nheads
    finally:
        checks.META_OK.reset(token)


def test_persistent_forward_ring_count_within_int32():
    """The persistent Gluon forward's CTAs each count their ring positions (their tiles' key blocks + 1) in int32:
    a single head of 2**26 tokens (2**19 tiles over 132 SMs, 2**20 + 1 positions each: 4e9) takes another kernel,
    one of 2**24 the persistent one."""
    explain = importlib.import_module("flashattn2.explain")
    token = checks.META_OK.set(True)
    try:
        for seqlen, ok in ((2**24, True), (2**26, False)):
            q = _meta(1, seqlen, 1, 128)
            plan = planning.plan(explain._on("sm90", explain._attention_spec(q, q, q, {})))
            if ok and not plan.gluon:
                pytest.skip("the Gluon kernels do not run on this Triton release")
            assert (plan.kernel == "fwd_hopper_persist") is ok, (seqlen, plan.kernel)
    finally:
        checks.META_OK.reset(token)


def test_kv_tma_rows_within_int32():
    """The latent cache's TMA path addresses the cache's rows (pages x page size) with an int32 coordinate: it takes
    caches of fewer than 2**31 rows, the pointer loop the others."""
    for pages, ok in ((2**31 // 256 - 1, True), (2**31 // 256, False)):
        k = _meta(pages, 256, 1, 576)
        v = k[..., :512]
        q = _meta(1, 1, 16, 576)
        table = _meta(1, 4, dtype=torch.int32)
        s = specs.kvcache(KVCacheRequest(q, k, v, block_table=table, num_splits=1))
        plan = planning.decode(planning.kvcache_cache(s), "sm90", planning.Forced(), False, 1, 132)
        assert plan.kv_tma is ok, pages


def test_kvcache_append_heads_far_apart(tmp_path):
    """Appending into a head-major cache whose last head starts 2**31 elements past its first (the decode kernel
    reads it right: its head offsets are int64). The append wrote head 8's keys 2**31 elements before their place
    when it added h * stride_h in int32 (here still inside the buffer: a wrong result rather than a fault)."""
    nheads, d, stride_h, offset, seqlen = 9, 8, 2**28, 2**31, 4
    k_cache, v_cache = (
        huge(tmp_path / name, offset + nheads * stride_h, torch.float32).as_strided(
            (1, seqlen, nheads, d), (seqlen * d, d, stride_h, 1), offset
        )
        for name in ("k", "v")
    )
    for cache in (k_cache, v_cache):
        cache.copy_(randn(1, seqlen, nheads, d, dtype=torch.float32))
    k, v = randn(1, 2, nheads, d, dtype=torch.float32), randn(1, 2, nheads, d, dtype=torch.float32)
    q = randn(1, 1, nheads, d, dtype=torch.float32)
    out = flashattn2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=1)
    torch.testing.assert_close(k_cache[:, 1:3], k)
    torch.testing.assert_close(v_cache[:, 1:3], v)
    torch.testing.assert_close(out, attention_ref(q, k_cache[:, :3], v_cache[:, :3])[0].to(out.dtype))
