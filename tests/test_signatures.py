"""The public callables of modules.mha, layers.rotary and bert_padding, and flash_attn_interface's private
functions, take flash_attn 2.8's parameters: the same names in the same order with the same defaults, so a
positional call written for flash_attn lands in the same slots. flashattn2's own additions may only follow,
keyword-only. flash_attn_interface names everything flash_attn's module does.

The expected signatures are literal data copied from flash_attn 2.8.3's source
(flash_attn/modules/mha.py, flash_attn/layers/rotary.py, flash_attn/bert_padding.py,
flash_attn/flash_attn_interface.py)."""

import inspect

import pytest

import flashattn2
from flashattn2 import bert_padding
from flashattn2 import flash_attn_interface as fai
from flashattn2.layers import rotary
from flashattn2.modules import mha

EMPTY = inspect.Parameter.empty
# flash_attn 2.8's parameters (flash_attn/flash_attn_interface.py), in order, with their defaults; the varlen
# forward's trailing num_splits is in ../shared/FLASH_ATTN_API.md's signature, not in 2.8.3's (accepted, a speed knob)
PRIVATE_2_8 = {
    "_flash_attn_forward": (
        [
            "q",
            "k",
            "v",
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size_left",
            "window_size_right",
            "softcap",
            "alibi_slopes",
            "return_softmax",
        ],
        {},
    ),
    "_flash_attn_varlen_forward": (
        [
            "q",
            "k",
            "v",
            "cu_seqlens_q",
            "cu_seqlens_k",
            "max_seqlen_q",
            "max_seqlen_k",
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size_left",
            "window_size_right",
            "softcap",
            "alibi_slopes",
            "return_softmax",
            "block_table",
            "leftpad_k",
            "seqused_k",
            "zero_tensors",
            "num_splits",
        ],
        dict(
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            return_softmax=False,
            block_table=None,
            leftpad_k=None,
            seqused_k=None,
            zero_tensors=False,
            num_splits=0,
        ),
    ),
    "_flash_attn_backward": (
        [
            "dout",
            "q",
            "k",
            "v",
            "out",
            "softmax_lse",
            "dq",
            "dk",
            "dv",
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size_left",
            "window_size_right",
            "softcap",
            "alibi_slopes",
            "deterministic",
            "rng_state",
        ],
        dict(rng_state=None),
    ),
    "_flash_attn_varlen_backward": (
        [
            "dout",
            "q",
            "k",
            "v",
            "out",
            "softmax_lse",
            "dq",
            "dk",
            "dv",
            "cu_seqlens_q",
            "cu_seqlens_k",
            "max_seqlen_q",
            "max_seqlen_k",
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size_left",
            "window_size_right",
            "softcap",
            "alibi_slopes",
            "deterministic",
            "rng_state",
            "zero_tensors",
        ],
        dict(rng_state=None, zero_tensors=False),
    ),
}
PUBLIC = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
CLASSES = [
    "FlashAttnFunc",
    "FlashAttnQKVPackedFunc",
    "FlashAttnKVPackedFunc",
    "FlashAttnVarlenFunc",
    "FlashAttnVarlenQKVPackedFunc",
    "FlashAttnVarlenKVPackedFunc",
]

MHA_INIT = [
    "self",
    "embed_dim",
    "num_heads",
    "num_heads_kv",
    "cross_attn",
    "qkv_proj_bias",
    "out_proj_bias",
    "dropout",
    "softmax_scale",
    "causal",
    "layer_idx",
    "dwconv",
    "rotary_emb_dim",
    "rotary_emb_base",
    "rotary_emb_scale_base",
    "rotary_emb_interleaved",
    "use_alibi",
    "window_size",
    "fused_bias_fc",
    "use_flash_attn",
    "return_residual",
    "checkpointing",
    "device",
    "dtype",
]
MHA_INIT_DEFAULTS = dict(
    num_heads_kv=None,
    cross_attn=False,
    qkv_proj_bias=True,
    out_proj_bias=True,
    dropout=0.0,
    softmax_scale=None,
    causal=False,
    layer_idx=None,
    dwconv=False,
    rotary_emb_dim=0,
    rotary_emb_base=10000.0,
    rotary_emb_scale_base=None,
    rotary_emb_interleaved=False,
    use_alibi=False,
    window_size=(-1, -1),
    fused_bias_fc=False,
    use_flash_attn=False,
    return_residual=False,
    checkpointing=False,
    device=None,
    dtype=None,
)

# (module, dotted name, parameter names in order ("**kwargs" for a VAR_KEYWORD), defaults)
FLASH_ATTN_2_8 = [
    # flash_attn/modules/mha.py
    (mha, "get_alibi_slopes", ["nheads"], {}),
    (
        mha,
        "FlashSelfAttention.__init__",
        ["self", "causal", "softmax_scale", "attention_dropout", "window_size", "alibi_slopes", "deterministic"],
        dict(
            causal=False,
            softmax_scale=None,
            attention_dropout=0.0,
            window_size=(-1, -1),
            alibi_slopes=None,
            deterministic=False,
        ),
    ),
    (
        mha,
        "FlashSelfAttention.forward",
        ["self", "qkv", "causal", "cu_seqlens", "max_seqlen"],
        dict(causal=None, cu_seqlens=None, max_seqlen=None),
    ),
    (
        mha,
        "FlashCrossAttention.__init__",
        ["self", "causal", "softmax_scale", "attention_dropout", "alibi_slopes", "window_size", "deterministic"],
        dict(
            causal=False,
            softmax_scale=None,
            attention_dropout=0.0,
            alibi_slopes=None,
            window_size=(-1, -1),
            deterministic=False,
        ),
    ),
    (
        mha,
        "FlashCrossAttention.forward",
        ["self", "q", "kv", "causal", "cu_seqlens", "max_seqlen", "cu_seqlens_k", "max_seqlen_k"],
        dict(causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None),
    ),
    (
        mha,
        "SelfAttention.__init__",
        ["self", "causal", "softmax_scale", "attention_dropout"],
        dict(causal=False, softmax_scale=None, attention_dropout=0.0),
    ),
    (
        mha,
        "SelfAttention.forward",
        ["self", "qkv", "causal", "key_padding_mask"],
        dict(causal=None, key_padding_mask=None),
    ),
    (
        mha,
        "CrossAttention.__init__",
        ["self", "causal", "softmax_scale", "attention_dropout"],
        dict(causal=False, softmax_scale=None, attention_dropout=0.0),
    ),
    (
        mha,
        "CrossAttention.forward",
        ["self", "q", "kv", "causal", "key_padding_mask"],
        dict(causal=None, key_padding_mask=None),
    ),
    (mha, "MHA.__init__", MHA_INIT, MHA_INIT_DEFAULTS),
    (mha, "MHA.allocate_inference_cache", ["self", "batch_size", "max_seqlen", "dtype"], dict(dtype=None)),
    (
        mha,
        "MHA.forward",
        [
            "self",
            "x",
            "x_kv",
            "key_padding_mask",
            "cu_seqlens",
            "max_seqlen",
            "mixer_subset",
            "inference_params",
            "**kwargs",
        ],
        dict(
            x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, mixer_subset=None, inference_params=None
        ),
    ),
    # flash_attn/layers/rotary.py
    (rotary, "rotate_half", ["x", "interleaved"], dict(interleaved=False)),
    (rotary, "apply_rotary_emb_torch", ["x", "cos", "sin", "interleaved"], dict(interleaved=False)),
    (
        rotary,
        "ApplyRotaryEmb.forward",
        ["ctx", "x", "cos", "sin", "interleaved", "inplace", "seqlen_offsets", "cu_seqlens", "max_seqlen"],
        dict(interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None),
    ),
    (rotary, "ApplyRotaryEmb.backward", ["ctx", "do"], {}),
    (
        rotary,
        "apply_rotary_emb",
        ["x", "cos", "sin", "interleaved", "inplace", "seqlen_offsets", "cu_seqlens", "max_seqlen"],
        dict(interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None),
    ),
    (
        rotary,
        "apply_rotary_emb_func",
        ["x", "cos", "sin", "interleaved", "inplace", "seqlen_offsets", "cu_seqlens", "max_seqlen"],
        dict(interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None),
    ),
    (
        rotary,
        "ApplyRotaryEmbQKV_.forward",
        ["ctx", "qkv", "cos", "sin", "cos_k", "sin_k", "interleaved", "seqlen_offsets", "num_heads_q"],
        dict(cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None),
    ),
    (rotary, "ApplyRotaryEmbQKV_.backward", ["ctx", "dqkv"], {}),
    (
        rotary,
        "apply_rotary_emb_qkv_",
        ["qkv", "cos", "sin", "cos_k", "sin_k", "interleaved", "seqlen_offsets", "num_heads_q"],
        dict(cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None),
    ),
    (
        rotary,
        "ApplyRotaryEmbKV_.forward",
        ["ctx", "kv", "cos", "sin", "interleaved", "seqlen_offsets"],
        dict(interleaved=False, seqlen_offsets=0),
    ),
    (rotary, "ApplyRotaryEmbKV_.backward", ["ctx", "dkv"], {}),
    (
        rotary,
        "apply_rotary_emb_kv_",
        ["kv", "cos", "sin", "interleaved", "seqlen_offsets"],
        dict(interleaved=False, seqlen_offsets=0),
    ),
    (
        rotary,
        "RotaryEmbedding.__init__",
        ["self", "dim", "base", "interleaved", "scale_base", "device"],
        dict(base=10000.0, interleaved=False, scale_base=None, device=None),
    ),
    # MHA (flash_attn's and ours) calls it to build the cos/sin tables for the KV-cache kernel
    (
        rotary,
        "RotaryEmbedding._update_cos_sin_cache",
        ["self", "seqlen", "device", "dtype"],
        dict(device=None, dtype=None),
    ),
    (
        rotary,
        "RotaryEmbedding.forward",
        ["self", "qkv", "kv", "seqlen_offset", "max_seqlen", "num_heads_q"],
        dict(kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None),
    ),
    # flash_attn/bert_padding.py
    (bert_padding, "IndexFirstAxis.forward", ["ctx", "input", "indices"], {}),
    (bert_padding, "IndexFirstAxis.backward", ["ctx", "grad_output"], {}),
    (bert_padding, "IndexPutFirstAxis.forward", ["ctx", "values", "indices", "first_axis_dim"], {}),
    (bert_padding, "IndexPutFirstAxis.backward", ["ctx", "grad_output"], {}),
    (bert_padding, "IndexFirstAxisResidual.forward", ["ctx", "input", "indices"], {}),
    (bert_padding, "IndexFirstAxisResidual.backward", ["ctx", "grad_output", "grad_residual"], {}),
    (bert_padding, "unpad_input", ["hidden_states", "attention_mask", "unused_mask"], dict(unused_mask=None)),
    (bert_padding, "unpad_input_for_concatenated_sequences", ["hidden_states", "attention_mask_in_length"], {}),
    (bert_padding, "pad_input", ["hidden_states", "indices", "batch", "seqlen"], {}),
]

# the names flash_attn 2.8 defines in these modules (imports excluded), and those left out
PUBLIC_NAMES = {
    mha: ["get_alibi_slopes", "FlashSelfAttention", "FlashCrossAttention", "SelfAttention", "CrossAttention", "MHA"],
    rotary: [
        "rotate_half",
        "apply_rotary_emb_torch",
        "ApplyRotaryEmb",
        "apply_rotary_emb",
        "apply_rotary_emb_func",
        "ApplyRotaryEmbQKV_",
        "apply_rotary_emb_qkv_",
        "ApplyRotaryEmbKV_",
        "apply_rotary_emb_kv_",
        "RotaryEmbedding",
    ],
    bert_padding: [
        "IndexFirstAxis",
        "index_first_axis",
        "IndexPutFirstAxis",
        "index_put_first_axis",
        "IndexFirstAxisResidual",
        "index_first_axis_residual",
        "unpad_input",
        "unpad_input_for_concatenated_sequences",
        "pad_input",
    ],
}
# ParallelMHA needs torch.distributed process groups and fused_dense's Column/RowParallelLinear
LEFT_OUT = {mha: ["ParallelMHA"]}


def resolve(module, dotted):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(
    "module, name, names, defaults",
    FLASH_ATTN_2_8,
    ids=[f"{m.__name__.rsplit('.', 1)[-1]}.{n}" for m, n, _, _ in FLASH_ATTN_2_8],
)
def test_signature_matches_flash_attn(module, name, names, defaults):
    params = list(inspect.signature(resolve(module, name)).parameters.values())
    ours = [("**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in params]
    assert ours[: len(names)] == names, f"{name}: {ours} != flash_attn's {names}"
    for p in params[: len(names)]:
        if p.kind is p.VAR_KEYWORD:
            continue
        assert p.kind is p.POSITIONAL_OR_KEYWORD, f"{name}({p.name}) must be positional-or-keyword"
        expected = defaults.get(p.name, EMPTY)
        assert p.default == expected and type(p.default) is type(expected), (
            f"{name}({p.name}): default {p.default!r} != flash_attn's {expected!r}"
        )
    for p in params[len(names) :]:  # flashattn2's additions: after flash_attn's, keyword-only
        assert p.kind is p.KEYWORD_ONLY, f"{name}: extra parameter {p.name} must be keyword-only"
    assert set(defaults) <= set(names)


@pytest.mark.parametrize("module", list(PUBLIC_NAMES), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_public_names_present(module):
    missing = [n for n in PUBLIC_NAMES[module] if not hasattr(module, n)]
    assert not missing, f"{module.__name__} lacks flash_attn's {missing}"
    for name in LEFT_OUT.get(module, []):
        assert not hasattr(module, name)


def test_aliases_as_in_flash_attn():
    assert rotary.apply_rotary_emb_func is rotary.apply_rotary_emb
    assert bert_padding.index_first_axis == bert_padding.IndexFirstAxis.apply
    assert bert_padding.index_put_first_axis == bert_padding.IndexPutFirstAxis.apply
    assert bert_padding.index_first_axis_residual == bert_padding.IndexFirstAxisResidual.apply


@pytest.mark.parametrize("name", PUBLIC + CLASSES + list(PRIVATE_2_8))
def test_every_name_imports(name):
    assert hasattr(fai, name) and name in fai.__all__
    if name in PUBLIC:
        assert getattr(fai, name) is getattr(flashattn2, name)


@pytest.mark.parametrize("name", list(PRIVATE_2_8))
def test_private_signatures_are_flash_attn_2_8s(name):
    names, defaults = PRIVATE_2_8[name]
    params = inspect.signature(getattr(fai, name)).parameters
    assert list(params) == names
    assert {n: p.default for n, p in params.items() if p.default is not EMPTY} == defaults
    # ring-flash-attention's get_default_args reads them this way
    assert inspect.isfunction(getattr(fai, name)) and inspect.getfullargspec(getattr(fai, name)).args == names
