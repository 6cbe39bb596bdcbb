"""How far the FP8 forward's logsumexp is from the fp64 reference, row by row, over seeds (GPU): each seed's worst
row, its error beside its terms (the largest over its keys of sum |q_i k_i| * scale) and lse, and where it stands
(query position, its place in a 64-row tile, the keys it sees); beside it the bf16 kernel's error on the codes'
values (exact in bf16, no descales, against their own reference): the yardstick of all but the e4m3 dots' sums.

    python tools/fp8_lse_probe.py [--seeds 8] [--shape 2,333,517,8,2] [--headdims 128,256]
"""

from __future__ import annotations

import argparse

import torch

import flashattn2
from flashattn2.reference import attention_ref
from flashattn2.reference.fp8 import dequantize, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--shape", default="2,333,517,8,2")
    parser.add_argument("--headdims", default="128,256")
    args = parser.parse_args()
    b, sq, sk, h, hk = (int(x) for x in args.shape.split(","))
    for d in (int(x) for x in args.headdims.split(",")):
        for causal in (False, True):
            worst = []
            for seed in range(args.seeds):
                torch.manual_seed(seed)
                made = []
                for shape in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)):
                    x = torch.randn(shape, device=DEVICE) * 2
                    descale = torch.rand(b, hk, device=DEVICE) * 1.5 + 0.5
                    x8 = quantize(x, descale)
                    made.append((x8, descale, dequantize(x8, descale)))
                (q, qd, q64), (k, kd, k64), (v, vd, v64) = made
                out, lse, _ = flashattn2.flash_attn_func(
                    q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True
                )
                # the codes' values (no descales) through the bf16 kernel, against their own reference
                codes = [t.to(torch.float64) for t in (q, k, v)]
                _, lse16, _ = flashattn2.flash_attn_func(
                    *(t.to(torch.bfloat16) for t in codes), causal=causal, return_attn_probs=True
                )
                _, ref16 = attention_ref(*codes, causal=causal, upcast=False)
                _, ref = attention_ref(q64, k64, v64, causal=causal, upcast=False)
                group = h // hk
                kk = k64.abs().repeat_interleave(group, dim=2)
                terms = torch.einsum("bqhd,bkhd->bhqk", q64.abs(), kk).amax(-1) * d**-0.5
                finite = torch.isfinite(ref)
                err = (lse.double() - ref).abs().where(finite, 0)
                err16 = (lse16.double() - ref16).abs().where(finite, 0)
                ratio = err / terms
                i = int(err.argmax())
                bi, hi, qi = (int(x) for x in torch.unravel_index(torch.tensor(i), err.shape))
                sees = sk if not causal else min(sk, qi + sk - sq + 1)
                worst.append(
                    (
                        float(err.max()),
                        float(ratio.max()),
                        float(err16.max()),
                        float(ref[bi, hi, qi]),
                        float(terms[bi, hi, qi]),
                        (bi, hi, qi, qi % 64, sees),
                        float((lse.double() - ref).where(finite, 0).mean()),
                    )
                )
            print(f"d{d} {'causal' if causal else 'full'} {b}x{sq}x{sk} h{h}/{hk}:")
            for e, r, e16, lr, t, where, bias in worst:
                print(
                    f"  err {e:.5f} (2^{torch.tensor(r).log2().item():.1f} of terms, terms {t:.1f}, lse {lr:.2f}, "
                    f"bf16 path err {e16:.2e}, mean signed err {bias:+.2e}) at (b, h, q, q%64, keys) {where}"
                )


if __name__ == "__main__":
    main()
