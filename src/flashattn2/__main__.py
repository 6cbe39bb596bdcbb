"""python -m flashattn2 [bench] [filters] | bench report | summary | features | decode | gpt | generate | ab | parallel
python -m flashattn2 explain [shape and options]: the plan of a call (python -m flashattn2 explain --help)

With a CUDA GPU: the kernel benchmark (flashattn2 beside SDPA's flash, cuDNN and efficient
kernels and naive PyTorch), appended to a CSV, then the table and plots. Without one: the
kernels run through Triton's CPU interpreter on small shapes and are checked against the
reference.
"""

from __future__ import annotations

import argparse
import os
import sys

RESULTS = os.path.join("bench", "results")


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def _parser():
    ap = argparse.ArgumentParser(
        prog="python -m flashattn2", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "command",
        nargs="?",
        default="bench",
        choices=["bench", "check"],
        help="bench (default): the benchmark, or the CPU check without a GPU; check: the CPU check",
    )
    ap.add_argument(
        "what",
        nargs="?",
        default="kernels",
        choices=["kernels", "report", "summary", "features", "decode", "gpt", "generate", "ab", "parallel", "host"],
        help="kernels (default): measure; report: only rebuild table and plots from the CSV; "
        "summary: the README's benchmark summary from bench/results/ (--write: into README.md); "
        "features: what varlen, window and the other options cost (headdim 128 by default); "
        "decode: GB/s of K/V read when decoding over a KV cache; "
        "gpt: training-step TFLOP/s of GPT3-1.3B/2.7B shapes (the paper's end-to-end table); "
        "generate: tokens/s of transformers' generate() with a static cache, compiled, beside sdpa (--batches 1,16); "
        "ab: flashattn2 under two or more settings (--setting), alternated in one run; "
        "parallel: context parallelism's per-GPU TFLOP/s, the ranks simulated on one GPU (--worlds), or under "
        "torchrun one rank per GPU (NCCL), beside PyTorch's context_parallel; "
        "host: host time per call of each entry point beside SDPA's and an empty custom op (on the CPU: launches "
        "stubbed; results into bench/results/host-<device>.csv/.md)",
    )
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="0,1", help="0, 1 or 0,1")
    ap.add_argument("--modes", default="fwd,bwd,fwd_bwd")
    ap.add_argument("--providers", default="flashattn2,sdpa_flash,sdpa_cudnn,sdpa_efficient,naive")
    ap.add_argument("--csv", default=None, help="results CSV (appended); default bench/results/kernels-<gpu>.csv")
    ap.add_argument("--plots", default=None, help="folder for PNGs; default beside the CSV")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--write", action="store_true", help="summary: write it into README.md (else print it)")
    ap.add_argument("--nheads", type=int, default=None, help="kernels: query heads (default 2048 / headdim)")
    ap.add_argument(
        "--nheads-k",
        type=int,
        default=None,
        help="kernels: K/V heads (default nheads; fewer: GQA, e.g. --nheads 32 --nheads-k 8)",
    )
    ap.add_argument(
        "--baseline",
        default=None,
        help="features / decode: a package built by tools/baseline_pkg.py to compare with (features: "
        "'features off'; decode: timed beside flashattn2 in alternating rounds)",
    )
    ap.add_argument(
        "--cases",
        default="varlen,window,off,on,sinks",
        help="features: which cases (varlen, window, off, on, sinks; dv, d512, mla: bench/headdims.py)",
    )
    ap.add_argument("--batches", default="1,8,64", help="decode: batch sizes")
    ap.add_argument("--caches", default="1024,8192,32768,131072", help="decode: cache lengths")
    ap.add_argument("--kv-heads", default="32,8", help="decode: K/V heads (32 query heads)")
    ap.add_argument(
        "--layouts",
        default="contiguous,paged-16,paged-256,contiguous-unchecked",
        help="decode: flashattn2's cache layouts (-unchecked: set_kvcache_checks(False), eager only)",
    )
    ap.add_argument("--timings", default="eager,graph", help="decode: eager and/or graph (CUDA graph replay)")
    ap.add_argument("--models", default="gpt3-1.3b,gpt3-2.7b", help="gpt: model shapes")
    ap.add_argument("--contexts", default="2048,8192", help="gpt: context lengths")
    ap.add_argument("--attentions", default="flashattn2,sdpa_flash,sdpa_cudnn,naive", help="gpt: what runs attention")
    ap.add_argument("--tokens", type=int, default=16384, help="gpt: tokens per training step")
    ap.add_argument("--steps", type=int, default=10, help="gpt: timed steps (after 3 warm-up steps)")
    ap.add_argument(
        "--setting",
        action="append",
        default=None,
        help="ab: a setting, given twice or more: ops.planning.force arguments ('hopper=0', "
        "'fwd_hopper_persist=64x64w8s2'; 'default'), or 'pkg:NAME' (tools/baseline_pkg.py)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="kernels / ab: rounds alternating the providers / settings, odd ones in reverse order "
        "(median reported; default 1 / 3)",
    )
    ap.add_argument("--no-cudnn", action="store_true", help="ab: leave SDPA's cuDNN kernels out")
    ap.add_argument("--worlds", default="8", help="parallel: simulated world sizes (under torchrun: its world)")
    ap.add_argument("--algorithms", default="zigzag,ulysses", help="parallel: zigzag, ring, ulysses")
    ap.add_argument("--reps", type=int, default=3, help="parallel: timed calls per point (median)")
    return ap


def _cpu_check(argv) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        # triton reads TRITON_INTERPRET when first imported, and torch has imported it by now
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "flashattn2", *argv])
    from .bench import cpu_check

    return 0 if cpu_check.run() else 1


def _report(path, plots):
    from .bench import report

    if not os.path.exists(path):
        print(f"no results at {path}")
        return 1
    latest = report.load(path)
    text = report.markdown(latest)
    md_path = os.path.splitext(path)[0] + ".md"
    with open(md_path, "w") as fh:
        fh.write(text + "\n")
    print(text)
    for p in report.plot(latest, plots or os.path.join(os.path.dirname(path), "plots")):
        print("wrote", p)
    print("wrote", md_path)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["explain"]:
        from .explain import main as explain

        return explain(argv[1:])
    args = _parser().parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        print(f"bench: --rounds must be 1 or more, got {args.rounds}")
        return 2
    import torch

    if args.what == "report":
        return _report(args.csv or _default_csv(None), args.plots)
    if args.what == "summary":
        from .bench import summary

        if args.write:
            print("README.md", "updated" if summary.write("README.md") else "unchanged")
        else:
            print(summary.render())
        return 0
    if args.what == "gpt":
        return _gpt(args)
    if args.what == "ab":
        return _ab(args)
    if args.what == "generate":
        return _generate(args)
    if args.what == "parallel":
        return _parallel(args)
    if args.what == "host":
        return _host(args, argv)
    if args.command == "check" or not torch.cuda.is_available():
        return _cpu_check(argv)
    if args.what == "features":
        return _features(args)
    if args.what == "decode":
        return _decode(args)
    from .bench import kernels

    names = args.providers.split(",")
    unknown = set(names) - {"flashattn2", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "naive"}
    if unknown:
        print(f"unknown provider(s): {sorted(unknown)}")
        return 2
    path = args.csv or _default_csv(torch.cuda.get_device_name())
    kernels.run_grid(
        path,
        args.dtypes.split(","),
        _ints(args.headdims),
        _ints(args.seqlens),
        [bool(c) for c in _ints(args.causal)],
        args.modes.split(","),
        names,
        progress=not args.no_progress,
        nheads=args.nheads,
        nheads_k=args.nheads_k,
        rounds=args.rounds or 1,
    )
    return _report(path, args.plots)


def _host(args, argv):
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported: run again with it
        os.execv(sys.executable, [sys.executable, "-m", "flashattn2", *argv])
    from .bench import host

    slug = "cpu" if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" else None
    slug = slug or _slug(torch.cuda.get_device_name())
    path = args.csv or os.path.join(RESULTS, f"host-{slug}.csv")
    return host.main(path, os.path.splitext(path)[0] + ".md", args.rounds or 7)


def _features(args):
    import torch

    from .bench import features

    path = args.csv or os.path.join(RESULTS, f"features-{_slug(torch.cuda.get_device_name())}.csv")
    headdim = _ints(args.headdims)[-1] if args.headdims != "64,128" else 128
    features.run(path, args.dtypes.split(","), headdim, args.modes.split(","), args.baseline, args.cases.split(","))
    return _write_markdown(path, features.markdown(path))


def _decode(args):
    import torch

    from .bench import decode

    path = args.csv or os.path.join(RESULTS, f"decode-{_slug(torch.cuda.get_device_name())}.csv")
    decode.run(
        path,
        _ints(args.batches),
        _ints(args.caches),
        _ints(args.kv_heads),
        args.layouts.split(","),
        args.timings.split(","),
        peers="sdpa" in args.providers,
        baseline=args.baseline,
        rounds=args.rounds or 1,
    )
    return _write_markdown(path, decode.markdown(path))


def _ab(args):
    import torch

    from .bench import ab

    if not torch.cuda.is_available():
        print("bench ab times flashattn2 under several settings: it needs a CUDA GPU")
        return 2
    if not args.setting or len(args.setting) < 2:
        print("bench ab: give two or more --setting (e.g. --setting default --setting hopper=0)")
        return 2
    path = args.csv or os.path.join(RESULTS, f"ab-{_slug(torch.cuda.get_device_name())}.csv")
    rows = ab.run(
        args.setting,
        args.dtypes.split(","),
        _ints(args.headdims),
        _ints(args.seqlens),
        [bool(c) for c in _ints(args.causal)],
        args.modes.split(","),
        cudnn=not args.no_cudnn,
        rounds=args.rounds or 3,
        nheads=args.nheads,
        nheads_k=args.nheads_k,
        out_csv=path,
        progress=not args.no_progress,
    )
    print(ab.markdown(rows))
    return 0


def _gpt(args):
    import torch

    from .bench import gpt

    if not torch.cuda.is_available():
        print("bench gpt measures training steps of 1.3B/2.7B-parameter models: it needs a CUDA GPU")
        return 2
    unknown = set(args.models.split(",")) - set(gpt.MODELS)
    if unknown:
        print(f"unknown model(s) {sorted(unknown)}; expected some of {sorted(gpt.MODELS)}")
        return 2
    path = args.csv or os.path.join(RESULTS, f"gpt-{_slug(torch.cuda.get_device_name())}.csv")
    gpt.run(path, args.models.split(","), _ints(args.contexts), args.attentions.split(","), args.tokens, args.steps)
    return _write_markdown(path, gpt.markdown(path))


def _generate(args):
    import torch

    from .bench import generate

    if not torch.cuda.is_available():
        print("bench generate measures a 1.2B-parameter model's generate(): it needs a CUDA GPU")
        return 2
    batches = _ints(args.batches) if args.batches != "1,8,64" else [1, 16]  # decode's default is not this one's
    path = args.csv or os.path.join(RESULTS, f"generate-{_slug(torch.cuda.get_device_name())}.csv")
    generate.run(path, batches=batches)
    return 0


def _parallel(args):
    import torch

    from .bench import parallel

    if not torch.cuda.is_available():
        print("bench parallel times attention over sequences of 128k tokens and more: it needs a CUDA GPU")
        return 2
    if os.environ.get("WORLD_SIZE"):  # under torchrun: one rank per GPU
        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    seqlens = _ints(args.seqlens) if args.seqlens != _parser().get_default("seqlens") else [131072]
    modes = args.modes.split(",") if args.modes != _parser().get_default("modes") else ["fwd", "fwd_bwd"]
    path = args.csv or os.path.join(RESULTS, f"parallel-{_slug(torch.cuda.get_device_name())}.csv")
    parallel.run(path, seqlens, _ints(args.worlds), args.algorithms.split(","), modes, reps=args.reps)
    return _write_markdown(path, parallel.markdown(path)) if int(os.environ.get("RANK", "0")) == 0 else 0


def _slug(gpu: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-")


def _write_markdown(csv_path: str, text: str) -> int:
    with open(os.path.splitext(csv_path)[0] + ".md", "w") as fh:
        fh.write(text + "\n")
    print(text)
    return 0


def _default_csv(gpu):
    import glob

    if gpu is None:  # report only: the newest CSV there
        found = sorted(glob.glob(os.path.join(RESULTS, "kernels-*.csv")), key=os.path.getmtime)
        return found[-1] if found else os.path.join(RESULTS, "kernels.csv")
    return os.path.join(RESULTS, f"kernels-{_slug(gpu)}.csv")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
