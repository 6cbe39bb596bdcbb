"""ops.request.request: each public function's arguments become one request at its door, in its signature's order (the
door builds it positionally), and the custom op's schema is the request's fields in their op form."""

import inspect

import pytest
import torch

import flashattn2
from flashattn2.ops.run import registry
from flashattn2.ops.request import request
from flashattn2.ops.request.request import AttentionRequest, KVCacheRequest

DOORS = [
    pytest.param(flashattn2.flash_attn_with_kvcache, KVCacheRequest, (), id="flash_attn_with_kvcache"),
    pytest.param(flashattn2.flash_attn_varlen_func, AttentionRequest, (), id="flash_attn_varlen_func"),
    pytest.param(flashattn2.flash_attn_func, AttentionRequest, request.VARLEN_ONLY, id="flash_attn_func"),
]
# the packed doors: their parameters from dropout_p on are the request's, less those it lacks
PACKED = [
    pytest.param(flashattn2.flash_attn_qkvpacked_func, request.VARLEN_ONLY, id="qkvpacked"),
    pytest.param(flashattn2.flash_attn_kvpacked_func, request.VARLEN_ONLY, id="kvpacked"),
    pytest.param(flashattn2.flash_attn_varlen_qkvpacked_func, ("block_table",), id="varlen_qkvpacked"),
    pytest.param(flashattn2.flash_attn_varlen_kvpacked_func, ("block_table",), id="varlen_kvpacked"),
]

# flashattn2::fwd_kvcache's parameters, as torch.export'ed graphs and opcheck'ed calls name them
FWD_KVCACHE_OP = [
    "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_seqlen_int",
    "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal", "window_left", "window_right",
    "softcap", "rotary_interleaved", "alibi_slopes", "num_splits", "learnable_sink", "q_descale", "k_descale",
    "v_descale",
]  # fmt: skip


FWD_KVCACHE_SCHEMA = (
    "flashattn2::fwd_kvcache(Tensor q, Tensor(a1!) k_cache, Tensor(a2!) v_cache, Tensor? k, Tensor? v, "
    "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_seqlens, SymInt cache_seqlen_int, Tensor? cache_batch_idx, "
    "Tensor? cache_leftpad, Tensor? block_table, float softmax_scale, bool causal, SymInt window_left, "
    "SymInt window_right, float softcap, bool rotary_interleaved, Tensor? alibi_slopes, SymInt num_splits, "
    "Tensor? learnable_sink=None, Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None) "
    "-> (Tensor, Tensor)"
)


@pytest.mark.parametrize("door, request_type, lacks", DOORS)
def test_request_fields_are_the_door_parameters(door, request_type, lacks):
    """A door makes its request positionally from its parameters: they are the request's fields, in order."""
    params = inspect.signature(door).parameters
    assert list(params) == [f for f in request_type._fields if f not in lacks]
    defaults = request_type._field_defaults
    for name, p in params.items():  # (a request's default stands for a field its dense door lacks)
        if p.default is not inspect.Parameter.empty or name not in defaults:
            assert p.default == defaults.get(name, inspect.Parameter.empty), name


@pytest.mark.parametrize("door, lacks", PACKED)
def test_packed_doors_options_are_the_request_fields(door, lacks):
    params = list(inspect.signature(door).parameters)
    fields = list(AttentionRequest._fields)
    first = fields.index("dropout_p")
    assert params[params.index("dropout_p") :] == [f for f in fields[first:] if f not in lacks]


def test_fwd_kvcache_schema_is_the_request_op_form():
    assert list(inspect.signature(registry._fwd_kvcache_impl).parameters) == FWD_KVCACHE_OP
    assert str(registry.fwd_kvcache._opoverload._schema) == FWD_KVCACHE_SCHEMA


@pytest.mark.parametrize(
    "seqlens", [pytest.param(7, id="int"), pytest.param(None, id="none"), pytest.param("tensor", id="tensor")]
)
def test_op_args_round_trip(seqlens):
    t = lambda *s: torch.randn(*s)  # noqa: E731
    q, kc, vc = t(2, 1, 4, 16), t(2, 32, 2, 16), t(2, 32, 2, 16)
    seqlens = torch.tensor([3, 5], dtype=torch.int32) if seqlens == "tensor" else seqlens
    r = KVCacheRequest(q, kc, vc, cache_seqlens=seqlens, window_size=(4, 0), softcap=1.5, num_splits=2)
    args = request.op_args(r)
    assert len(args) == len(FWD_KVCACHE_OP)
    named = dict(zip(FWD_KVCACHE_OP, args))
    assert named["softmax_scale"] == 16**-0.5 and (named["window_left"], named["window_right"]) == (4, 0)
    assert named["cache_seqlen_int"] == (32 if seqlens is None else 0 if isinstance(seqlens, torch.Tensor) else 7)
    back = request.from_op_args(KVCacheRequest, args)
    assert (
        back.cache_seqlens is seqlens
        if isinstance(seqlens, torch.Tensor)
        else back.cache_seqlens == named["cache_seqlen_int"]
    )
    assert back.window_size == (4, 0) and back.softcap == 1.5 and back.num_splits == 2 and back.return_softmax_lse
    assert back.q is q and back.learnable_sink is None and back.descales == (None, None, None)
    short = request.from_op_args(KVCacheRequest, args[:-4])  # the optional trailing parameters left out
    assert short.learnable_sink is None and short.v_descale is None


def test_with_qkv_keeps_the_other_fields():
    assert AttentionRequest._fields[:3] == ("q", "k", "v")
    r = AttentionRequest(*(torch.zeros(1) for _ in range(3)), softcap=2.5, learnable_sink=torch.ones(1))
    q, k, v = (torch.ones(2) for _ in range(3))
    swapped = request.with_qkv(r, q, k, v)
    assert type(swapped) is AttentionRequest and swapped[:3] == (q, k, v) and swapped[3:] == r[3:]
