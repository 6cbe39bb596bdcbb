"""Where an eager generate() decode step's time goes (GPU): bench generate's model (Llama 3.2 1B's shape, random
weights) with attn_implementation "flashattn2" and "sdpa", a left-padded prompt, then decode steps timed one by one
(the model's forward over the dynamic cache, as generate() calls it), alternating the two attentions, and one step of
each under torch.profiler: the host time of the attention layers (CPU self time by op: Python-side ops, kernel
launches, synchronizing calls) and the GPU's kernels, so that a step's difference is told host from device.

    python tools/generate_profile.py [--batch 1] [--prompt 512] [--steps 32] [--rows 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashattn2.bench.generate import MODELS, _model, prompt_ids


def decoder(attention: str, batch: int, prompt: int, dims: dict | None = None, device: str = "cuda"):
    """(prefill, step) of `attention`'s model (dims: bench generate's model unless given): prefill() starts a new
    dynamic cache with a left-padded prompt, step() runs one more decode step over it (a greedy token; the cache
    grows) and returns the tokens."""
    from transformers import DynamicCache

    dims = dims or MODELS["llama-1b"]
    model = _model(dims, attention, device)
    ids, mask = prompt_ids(dims, batch, prompt, True, device)
    state = {}

    @torch.no_grad()
    def prefill():
        state["cache"] = DynamicCache()
        out = model(ids, attention_mask=mask, past_key_values=state["cache"], use_cache=True)
        state.update(token=out.logits[:, -1:].argmax(-1), mask=mask, position=mask.sum(-1, keepdim=True) - 1)

    @torch.no_grad()
    def step():
        state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(batch, 1)], dim=1)
        state["position"] = state["position"] + 1
        out = model(
            state["token"],
            attention_mask=state["mask"],
            position_ids=state["position"],
            past_key_values=state["cache"],
            use_cache=True,
        )
        state["token"] = out.logits[:, -1:].argmax(-1)
        return state["token"]

    return prefill, step


def _labelled() -> None:
    """Each attention implementation's calls under a profiler label of its own ("attention <name>"): the host time
    of the whole attention interface call, what it launches included."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def label(name, fn):
        def attention(*args, **kwargs):
            with torch.profiler.record_function(f"attention {name}"):
                return fn(*args, **kwargs)

        return attention

    for name in ("flashattn2", "sdpa"):
        ALL_ATTENTION_FUNCTIONS[name] = label(name, ALL_ATTENTION_FUNCTIONS[name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    import flashattn2.integrations.transformers  # noqa: F401  (registers "flashattn2")

    _labelled()
    runs = {name: decoder(name, args.batch, args.prompt) for name in ("flashattn2", "sdpa")}
    # warm-up: every length the timed steps see, once (compiles; cuDNN's plans are cached per shape, as the timed
    # generate() calls of bench generate find them after its warm-up call)
    for prefill, step in runs.values():
        prefill()
        for _ in range(args.steps + 1):
            step()
        prefill()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.steps):  # alternated, each step synchronized: wall time per step
        for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:
            start = time.perf_counter()
            runs[name][1]()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    for name, found in times.items():
        print(f"{name}: decode step {statistics.median(found):.2f} ms (median of {len(found)}), batch {args.batch}")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for name, (_, step) in runs.items():  # the step after the timed ones: a length seen in the warm-up
        with torch.profiler.profile(activities=acts) as prof:
            step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 1e3
        print(f"\n== {name}: one step under the profiler; GPU kernels' time {gpu:.2f} ms")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        ours = [e for e in events if e.key.startswith("attention ") or "attention" in e.key]
        print("\n".join(f"{e.key[:70]:70} cpu {e.cpu_time_total / e.count:8.1f} us/call x{e.count}" for e in ours))
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows // 2))


if __name__ == "__main__":
    main()
