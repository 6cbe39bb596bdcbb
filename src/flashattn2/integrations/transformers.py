"""Hugging Face transformers on flashattn2's kernels: importing this module registers the attention
implementation "flashattn2", so that

    import flashattn2.integrations.transformers
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="flashattn2")

(or `model.set_attn_implementation("flashattn2")`) runs every attention layer on flashattn2,
for training (padding masks and packed sequences become varlen calls) and for `generate()`.
transformers (>= 5) is an optional dependency: `pip install flashattn2[transformers]`.

The model gets flash-attention-style masks (`None`, or the 2-D padding mask), as for
"flash_attention_2": causal is bottom-right aligned when the queries are the last tokens of the
keys (decoding, chunked prefill). A model's attention sinks (gpt-oss's `s_aux`) become learnable_sink; a value head
dim of its own (DeepSeek-V3's 192/128) runs as it is, without padding v.
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from ..bert_padding import index_first_axis, pad_input
from ..errors import ArgumentError

NAME = "flashattn2"


def _packed_cu_seqlens(position_ids: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """cu_seqlens of sequences packed into one row, told by position ids that restart; else None
    (the check reads the ids: a host sync, as transformers' own flash-attention path does)."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] == 1:
        return None
    ids = position_ids.reshape(-1)
    starts = torch.nonzero(ids == ids.min()).reshape(-1)
    if starts.numel() <= 1:
        return None
    return torch.cat([starts, starts.new_tensor([ids.numel()])]).to(torch.int32)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (batch, nheads, seqlen_q, headdim), key (batch, nheads_kv, seqlen_k,
    headdim), value (batch, nheads_kv, seqlen_k, headdim_v: DeepSeek-V3's differs from query's, unpadded);
    attention_mask None or (batch, seqlen_k), True/1 for the tokens to keep. Returns ((batch, seqlen_q, nheads,
    headdim_v), None)."""
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "attn_implementation='flashattn2' does not return attention weights (output_attentions=True); use 'eager'"
        )
    for name in ("position_bias", "head_mask"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attn_implementation='flashattn2': the model passes {name}, not supported")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    batch, seqlen_q = q.shape[:2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = dict(
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=bool(causal),
        softcap=softcap or 0.0,
        window_size=(-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1),
    )
    s_aux = kwargs.get("s_aux")  # gpt-oss's attention sinks: a logit per query head, in the model's dtype
    if s_aux is not None:
        options["learnable_sink"] = s_aux.float()

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and attention_mask is None:
        cu_q = _packed_cu_seqlens(kwargs.get("position_ids"), batch)
    if cu_q is not None:  # sequences packed into one row (a padding-free collator)
        cu_k = cu_q if cu_k is None else cu_k
        max_q = kwargs.get("max_length_q") or int((cu_q[1:] - cu_q[:-1]).max())
        max_k = kwargs.get("max_length_k") or int((cu_k[1:] - cu_k[:-1]).max())
        out = flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:]),
            k.reshape(-1, *k.shape[2:]),
            v.reshape(-1, *v.shape[2:]),
            cu_q.to(torch.int32),
            cu_k.to(torch.int32),
            max_q,
            max_k,
            **options,
        )
        return out.view(batch, seqlen_q, *out.shape[1:]), None
    if attention_mask is None:
        return flash_attn_func(q, k, v, **options), None
    if attention_mask.dim() != 2:
        raise ArgumentError(
            "attn_implementation='flashattn2' takes a 2-D padding mask (batch, seqlen_k) or None, got "
            f"shape {tuple(attention_mask.shape)}; the model builds it when its config names "
            "'flashattn2' (flashattn2.integrations.transformers registers the mask too)"
        )
    if attention_mask.shape[1] > k.shape[1]:
        raise ArgumentError(
            f"attn_implementation='flashattn2': the padding mask covers {attention_mask.shape[1]} positions, the "
            f"keys only {k.shape[1]}"
        )
    found = _found(attention_mask)
    if "keep" not in found:  # (once per forward: on a GPU a kernel of its own)
        found["keep"] = attention_mask.bool()
    keep = found["keep"]
    # a static cache's keys run past the tokens seen so far (the mask's length): those slots are empty
    if keep.shape[1] < k.shape[1]:
        k, v = k[:, : keep.shape[1]], v[:, : keep.shape[1]]
    if seqlen_q == 1 and not dropout and not torch.compiler.is_compiling():
        # decoding over a left-padded batch (generate()'s): each sequence's keys run from its padding to the mask's
        # end, so one kernel reads the cache where it stands: no gather of K and V, no host read per layer
        if "pads" not in found:
            found["pads"] = _left_pads(keep)
        if found["pads"] is not None:
            del options["dropout_p"]
            out = flash_attn_with_kvcache(q, k, v, cache_seqlens=keep.shape[1], cache_leftpad=found["pads"], **options)
            return out, None
    if "keys" not in found:
        found["keys"] = _rows(keep)
    k_indices, cu_k, max_k = found["keys"]
    k_unpad = index_first_axis(k.reshape(-1, *k.shape[2:]), k_indices)
    v_unpad = index_first_axis(v.reshape(-1, *v.shape[2:]), k_indices)  # the same rows: no second mask pass
    if seqlen_q == 1:  # decoding: every sequence's one query (a static cache's mask ends in free slots)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        out = flash_attn_varlen_func(q[:, 0], k_unpad, v_unpad, cu_q, cu_k, 1, max_k, **options)
        return out.unsqueeze(1), None
    # the queries are the last seqlen_q positions of the keys (prefill, chunked prefill)
    if seqlen_q == keep.shape[1]:  # prefill: the keys' rows
        q_indices, cu_q, max_q = k_indices, cu_k, max_k
    else:
        if ("queries", seqlen_q) not in found:
            found["queries", seqlen_q] = _rows(keep[:, -seqlen_q:])
        q_indices, cu_q, max_q = found["queries", seqlen_q]
    q_unpad = index_first_axis(q.reshape(-1, *q.shape[2:]), q_indices)
    out = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, **options)
    return pad_input(out, q_indices, batch, seqlen_q), None


# What this thread last derived from a padding mask: every layer of a forward gets the same mask tensor, so its rows
# (host reads: nonzero's size, the longest sequence) are found by the first layer and reused by the others.
_LAST_MASK = threading.local()


def _found(mask: torch.Tensor) -> dict:
    """The dict of what has been derived from mask, unchanged since (its version), by this thread; a new one for
    another mask. While torch.compile traces: an empty dict each call (the graph holds no Python state)."""
    if torch.compiler.is_compiling():
        return {}
    last = getattr(_LAST_MASK, "slot", None)
    if last is not None and last[0]() is mask and last[1] == mask._version:
        return last[2]
    found = {}
    _LAST_MASK.slot = (weakref.ref(mask), mask._version, found)
    return found


def _rows(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(indices, cu_seqlens, max_seqlen) of the kept positions of keep (batch, seqlen), as unpad_input's."""
    seqlens = keep.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten()).flatten()
    cu_seqlens = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(seqlens.max()) if seqlens.numel() else 0


def _left_pads(keep: torch.Tensor) -> torch.Tensor | None:
    """Each sequence's padding, int32 (batch,), where every row of keep is padding then tokens (left padding, as
    generate() pads); else None. One host read."""
    pads = keep.shape[1] - keep.sum(1, dtype=torch.int32)
    tokens = torch.arange(keep.shape[1], device=keep.device) >= pads[:, None]
    return pads if torch.equal(tokens, keep) else None


def _serve_flash_imports(flash_utils, name: str) -> None:
    """transformers treats every implementation whose name holds "flash" as a flash-attention
    kernel and imports its functions by name when a model is configured (from the Hub, for a name
    it does not know). Answer that import with ours, so configuring "flashattn2" loads nothing and
    transformers' own flash-attention helpers (continuous batching) run on these kernels too."""
    original = flash_utils._lazy_imports
    if getattr(original, "flashattn2_names", None) is not None:
        original.flashattn2_names.add(name)
        return

    def _lazy_imports(implementation, *args, **kwargs):
        if implementation in _lazy_imports.flashattn2_names:
            return (
                flash_attn_func,
                flash_attn_varlen_func,
                flash_attn_with_kvcache,
                flash_utils._pad_input,
                flash_utils._unpad_input,
            )
        return original(implementation, *args, **kwargs)

    _lazy_imports.flashattn2_names = {name}
    flash_utils._lazy_imports = _lazy_imports


# Models that list the flash-attention kernels they accept (`_compatible_flash_implementations`: transformers swaps
# any other implementation whose name holds "flash" for the first of them) and whose needs flashattn2 meets:
# module -> the pretrained class holding the list. gpt-oss lists the kernels with attention sinks.
_COMPATIBLE_MODELS = {"transformers.models.gpt_oss.modeling_gpt_oss": "GptOssPreTrainedModel"}


def _declare_compatible(name: str) -> None:
    import importlib

    for module_name, cls_name in _COMPATIBLE_MODELS.items():
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):  # an older or newer transformers without the model
            continue
        listed = getattr(cls, "_compatible_flash_implementations", None)
        if listed is not None and name not in listed:
            cls._compatible_flash_implementations = [*listed, name]


def register(name: str = NAME) -> None:
    """Register the attention function and its mask (flash-attention style) with transformers
    under name (any name; "flashattn2" on import)."""
    from transformers import AttentionInterface, modeling_flash_attention_utils
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    _serve_flash_imports(modeling_flash_attention_utils, name)
    _declare_compatible(name)


register()

__all__ = ["NAME", "attention_forward", "register"]
