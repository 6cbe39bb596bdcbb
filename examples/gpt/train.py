"""Train a small GPT (flashattn2.models.gpt) on the Python standard library's own source files —
read from the running Python, nothing to download — on flashattn2's kernels, write the loss curve
as a PNG, then sample from the model through the KV cache.

    python examples/gpt/train.py                   # a CUDA GPU: ~11M parameters, a few minutes
    python examples/gpt/train.py --smoke           # 3 steps of a tiny model, on the CPU by default (its sample
                                                   # is unreadable bytes: 3 steps teach it nothing)
    torchrun --nproc-per-node 2 examples/gpt/train.py --context-parallel 2
                                                   # each sequence sharded over 2 ranks (zigzag ring attention)

Tokens are bytes (vocabulary 256). The loss is compared with the corpus' unigram entropy: the
loss of a model that knows only how often each byte occurs.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import sysconfig
import time


def cpu_warning(args, device) -> str | None:
    """What to say before a run without --smoke starts on the CPU: Triton's interpreter runs the kernels in Python,
    fine for the smoke model and far too slow for the default one."""
    if device.type != "cpu" or args.smoke:
        return None
    return (
        "train.py: on the CPU the kernels run through Triton's interpreter, thousands of times slower than on a GPU: "
        "a step of the default model takes minutes. `--smoke` trains a tiny model for 3 steps (under a minute); "
        "smaller --n-layer, --n-embd, --seqlen and --batch sit in between. Ctrl-C stops this run."
    )


class _Help(argparse.RawTextHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help with the docstring's layout kept and every option's default."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Help)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny model for 3 steps (CPU interpreter): sets the sizes after it as noted",
    )
    ap.add_argument("--device", default=None, help="cuda or cpu; None: cuda when there is one (not with --smoke)")
    ap.add_argument("--steps", type=int, default=3000, help="optimizer steps (--smoke: 3)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (--smoke: 2)")
    ap.add_argument("--seqlen", type=int, default=512, help="bytes per sequence (--smoke: 32)")
    ap.add_argument("--n-layer", type=int, default=6, help="transformer blocks (--smoke: 2)")
    ap.add_argument("--n-head", type=int, default=6, help="attention heads per block (--smoke: 2)")
    ap.add_argument("--n-embd", type=int, default=384, help="model width (--smoke: 64)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW; cosine down to a tenth)")
    ap.add_argument("--warmup", type=int, default=100, help="linear warmup steps (--smoke: 1)")
    ap.add_argument("--eval-every", type=int, default=250, help="steps between validation losses (--smoke: 2)")
    ap.add_argument("--max-bytes", type=int, default=64 << 20, help="corpus size cap (--smoke: 256 KiB)")
    ap.add_argument("--sample-tokens", type=int, default=400, help="bytes sampled after training (--smoke: 12)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the training step (fullgraph)")
    ap.add_argument("--seed", type=int, default=1337, help="the model's, the batches' and the sample's seed")
    ap.add_argument(
        "--context-parallel",
        type=int,
        default=1,
        metavar="N",
        help="shard every sequence over N ranks (launch with torchrun --nproc-per-node N): zigzag ring attention "
        "(flashattn2.parallel), gradients averaged over the ranks; NCCL on GPUs, gloo on the CPU",
    )
    ap.add_argument(
        "--out",
        default=str(pathlib.Path(__file__).resolve().parent / "out"),
        help="folder for loss.png and the final numbers",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.seqlen = 3, 2, 32
        args.n_layer, args.n_head, args.n_embd = 2, 2, 64
        args.warmup, args.eval_every, args.max_bytes, args.sample_tokens = 1, 2, 1 << 18, 12
    return args


def stdlib_corpus(max_bytes: int) -> bytes:
    """The standard library's .py files, in a fixed order, up to max_bytes."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_bytes()
        except OSError:
            continue
        chunks.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    if not chunks:
        sys.exit(f"no .py files under {root}")
    return b"\n".join(chunks)[:max_bytes]


def main(argv=None):
    args = parse_args(argv)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels run through Triton's interpreter (set before import)
    warning = cpu_warning(args, device)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    from flashattn2.models.gpt import GPT, GPTConfig

    cp = ContextParallel.start(args.context_parallel, device)
    device, log = cp.device, cp.log

    torch.manual_seed(args.seed)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    data = torch.frombuffer(bytearray(stdlib_corpus(args.max_bytes)), dtype=torch.uint8).long()
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    counts = torch.bincount(train, minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    unigram = float(-(p * p.log()).sum())
    log(f"corpus: {len(data) / 1e6:.1f} MB of Python standard library source; unigram entropy {unigram:.3f} nats/byte")

    config = GPTConfig(
        vocab_size=256, block_size=args.seqlen, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )
    model = GPT(config).to(device)
    cp.attach(model)
    log(f"model: {model.num_params() / 1e6:.2f}M parameters, {config}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    gen = torch.Generator().manual_seed(args.seed)

    def batch_of(source):
        starts = torch.randint(0, len(source) - args.seqlen - 1, (args.batch,), generator=gen)
        rows = torch.stack([source[s : s + args.seqlen + 1] for s in starts.tolist()]).to(device)
        return rows[:, :-1], rows[:, 1:]

    def train_step(x, y):
        x, y, positions = cp.shard(x), cp.shard(y), cp.shard(torch.arange(x.shape[1], device=device)[None])[0]
        with autocast:
            _, loss = model(x, targets=y, positions=positions)
        return loss

    step_fn = torch.compile(train_step, fullgraph=True) if args.compile else train_step

    @torch.no_grad()
    def evaluate(batches=4):
        model.eval()
        losses = [cp.mean(train_step(*batch_of(val))).item() for _ in range(batches)]
        model.train()
        return sum(losses) / len(losses)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 * args.lr + 0.9 * args.lr * 0.5 * (1 + math.cos(math.pi * progress))

    try:
        from tqdm import tqdm

        bar = tqdm(range(args.steps), desc="train", unit="step", disable=not cp.main)
    except ImportError:
        bar = range(args.steps)
    history, evals = [], []
    start = time.time()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = step_fn(*batch_of(train))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        cp.average_gradients(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(cp.mean(loss.detach()).item())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{history[-1]:.3f}")
        elif step % 50 == 0:
            log(f"step {step}: loss {history[-1]:.3f}", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals.append((step + 1, evaluate()))
    elapsed = time.time() - start
    val_loss = evals[-1][1]
    log(
        f"{args.steps} steps in {elapsed:.0f} s: train loss {history[-1]:.3f}, val loss {val_loss:.3f} nats/byte "
        f"({val_loss / unigram:.2f}x the unigram entropy {unigram:.3f})"
    )
    if not cp.main:
        cp.stop()
        return
    (out_dir / "result.txt").write_text(
        f"steps {args.steps}\nseconds {elapsed:.1f}\nunigram {unigram:.4f}\n"
        f"train_loss {history[-1]:.4f}\nval_loss {val_loss:.4f}\n"
        f"losses {' '.join(f'{x:.6f}' for x in history)}\n"
    )

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        log("matplotlib is not installed: no loss curve (pip install matplotlib)")
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(range(1, len(history) + 1), history, lw=0.8, label="train")
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="validation")
        ax.axhline(unigram, color="gray", ls="--", label=f"unigram entropy {unigram:.2f}")
        ax.set(xlabel="step", ylabel="loss (nats / byte)", title="GPT on the Python standard library")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # whole steps (a smoke run has 3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "loss.png", dpi=120)
        log(f"wrote {out_dir / 'loss.png'}")

    model.eval()
    cp.detach(model)  # sampling runs on this rank alone, the whole sequence here
    prompt = torch.tensor([list(b"def ")], device=device)
    with autocast:
        tokens = model.generate(prompt, max_new_tokens=args.sample_tokens, temperature=0.8, top_k=50)
    text = bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
    untrained = " (a few steps teach the model nothing: unreadable bytes are expected)" if args.steps < 100 else ""
    log(f"sample{untrained}:\n{text}")
    cp.stop()


class ContextParallel:
    """--context-parallel N: the ranks of a torchrun launch each hold a zigzag shard of every sequence (and of its
    positions and targets); the attention is flashattn2.parallel's zigzag ring, the loss each rank's mean over its
    tokens (equal counts: their mean is the whole batch's), the gradients averaged. N = 1: all of it is a no-op."""

    def __init__(self, world: int, rank: int, device):
        self.world, self.rank, self.device = world, rank, device
        self.main = rank == 0
        self._inner = {}

    @classmethod
    def start(cls, world: int, device):
        if world == 1:
            return cls(1, 0, device)
        import torch
        import torch.distributed as dist

        if int(os.environ.get("WORLD_SIZE", "1")) != world:
            sys.exit(f"--context-parallel {world}: launch with torchrun --nproc-per-node {world}")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(world, dist.get_rank(), device)

    def attach(self, model):
        if self.world == 1:
            return
        from flashattn2.parallel import ContextParallelAttention

        for block in model.blocks:
            self._inner[block] = block.attn.inner_cross_attn
            block.attn.inner_cross_attn = ContextParallelAttention(causal=True, algorithm="zigzag")

    def detach(self, model):
        for block, inner in self._inner.items():
            block.attn.inner_cross_attn = inner

    def shard(self, x):
        """This rank's zigzag shard of (batch, seqlen) tokens."""
        if self.world == 1:
            return x
        from flashattn2.parallel import shard

        return shard(x, self.world, self.rank, "zigzag", dim=1)

    def mean(self, value):
        if self.world == 1:
            return value
        import torch.distributed as dist

        value = value.detach().clone()
        dist.all_reduce(value)
        return value / self.world

    def average_gradients(self, model):
        if self.world == 1:
            return
        import torch.distributed as dist

        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= self.world

    def log(self, *args, **kwargs):
        """print, on rank 0 only."""
        if self.main:
            print(*args, **kwargs)

    def stop(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


if __name__ == "__main__":
    main()
