"""A GPT in the nanoGPT spirit on flashattn2's MHA: one dataclass config, one file.

Pre-norm blocks (LayerNorm, MHA, LayerNorm, GELU MLP), learned position embeddings (or rotary),
tied input/output embeddings. `GPT.generate` decodes through a KV cache: one prefill, then one
token per step through `flash_attn_with_kvcache`. `GPTConfig.attention` picks what runs the
attention, for the end-to-end benchmark: flashattn2's kernels, PyTorch's SDPA flash or cuDNN
kernels, or plain PyTorch ("naive", the attention matrix in memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..modules.mha import MHA
from ..errors import ArgumentError
from ..utils.generation import InferenceParams

ATTENTIONS = ("flashattn2", "sdpa_flash", "sdpa_cudnn", "naive")


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 1024  # the longest context: the position table's length
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: int | None = None  # fewer K/V heads than query heads: GQA / MQA
    n_embd: int = 384
    rotary_dim: int = 0  # > 0: rotary embeddings on that many features of each head, no position table
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm
    attention: str = "flashattn2"  # one of ATTENTIONS


class SDPAAttention(nn.Module):
    """MHA's inner attention on torch's scaled_dot_product_attention with one backend (the
    end-to-end benchmark's peers): forward(q, kv) as FlashCrossAttention, padded causal only."""

    def __init__(self, backend: str, causal: bool, dropout: float):
        super().__init__()
        from torch.nn.attention import SDPBackend

        self.backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
        self.causal, self.dropout = causal, dropout

    def forward(self, q, kv, **kwargs):
        from torch.nn.attention import sdpa_kernel

        if kwargs:
            raise NotImplementedError(f"SDPAAttention: {sorted(kwargs)}")
        k, v = kv.unbind(dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(self.backend):
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_p=self.dropout if self.training else 0.0,
                is_causal=self.causal,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        return out.transpose(1, 2)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MHA(
            config.n_embd,
            config.n_head,
            num_heads_kv=config.n_kv_head,
            qkv_proj_bias=config.bias,
            out_proj_bias=config.bias,
            dropout=config.dropout,
            causal=True,
            layer_idx=layer_idx,
            rotary_emb_dim=config.rotary_dim,
            use_flash_attn=config.attention != "naive",
        )
        if config.attention.startswith("sdpa"):
            self.attn.inner_cross_attn = SDPAAttention(config.attention, causal=True, dropout=config.dropout)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias),
            nn.Dropout(config.dropout),
        )

    def forward(self, x, inference_params=None):
        x = x + self.attn(self.ln_1(x), inference_params=inference_params)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.attention not in ATTENTIONS:
            raise ArgumentError(f"GPTConfig.attention must be one of {ATTENTIONS}, got {config.attention!r}")
        if config.n_embd % config.n_head:
            raise ArgumentError(f"GPTConfig: n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.rotary_dim == 0 else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("out_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - (self.wpe.weight.numel() if non_embedding and self.wpe is not None else 0)

    def forward(self, idx, targets=None, inference_params=None, positions=None):
        """idx (batch, seqlen) token ids; targets (batch, seqlen) for the mean cross-entropy (-1:
        ignored). With inference_params, positions continue from its seqlen_offset (or are given:
        (batch, seqlen))). Returns (logits (batch, seqlen, vocab), loss or None)."""
        seqlen = idx.shape[1]
        x = self.wte(idx)
        if self.wpe is not None:
            if positions is None:
                start = 0 if inference_params is None else inference_params.seqlen_offset
                if start + seqlen > self.config.block_size:
                    raise ArgumentError(
                        f"GPT: positions up to {start + seqlen} exceed block_size {self.config.block_size}"
                    )
                positions = torch.arange(start, start + seqlen, device=idx.device)
            x = x + self.wpe(positions)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, inference_params)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def decode_step(self, idx, inference_params):
        """One token per sequence, idx (batch, 1), against the KV cache after a prefill; the
        positions come from inference_params.lengths_per_sample (tokens already cached), so the
        step keeps its shapes from token to token (one torch.compile graph). Returns logits
        (batch, vocab) and advances the lengths."""
        lengths = inference_params.lengths_per_sample
        logits, _ = self(idx, inference_params=inference_params, positions=lengths[:, None])
        lengths += 1
        return logits[:, -1]

    def prefill(self, idx, max_seqlen):
        """A fresh KV cache for up to max_seqlen tokens, filled with idx (batch, seqlen). Returns
        (logits of the last position (batch, vocab), the InferenceParams for decode_step)."""
        if max_seqlen > self.config.block_size and self.wpe is not None:
            raise ArgumentError(f"GPT: max_seqlen {max_seqlen} exceeds block_size {self.config.block_size}")
        batch, seqlen = idx.shape
        params = InferenceParams(
            max_seqlen=max_seqlen,
            max_batch_size=batch,
            lengths_per_sample=torch.full((batch,), seqlen, dtype=torch.int32, device=idx.device),
        )
        logits, _ = self(idx, inference_params=params)
        params.seqlen_offset = seqlen  # decoding from now on: MHA takes the KV-cache kernel path
        return logits[:, -1], params

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, step=None):
        """Continue idx (batch, seqlen) by max_new_tokens sampled tokens (greedy at temperature 0),
        through the KV cache. step: the decode step to call (e.g. a torch.compile'd
        model.decode_step). Returns (batch, seqlen + max_new_tokens)."""
        step = self.decode_step if step is None else step
        logits, params = self.prefill(idx, idx.shape[1] + max_new_tokens)
        out = [idx]
        for i in range(max_new_tokens):
            if temperature == 0:
                token = logits.argmax(-1, keepdim=True)
            else:
                logits = logits.float() / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                token = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
            out.append(token)
            if i + 1 < max_new_tokens:
                logits = step(token, params)
                params.seqlen_offset += 1
        return torch.cat(out, dim=1)


__all__ = ["ATTENTIONS", "GPT", "GPTConfig", "SDPAAttention"]
