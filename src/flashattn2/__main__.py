"""python -m flashattn2: the benchmark, the CPU check and the plan of a call.

  python -m flashattn2 [bench] [WHAT] [options]   the benchmark (a CUDA GPU; without one, the CPU check)
  python -m flashattn2 check [options]            the kernels through Triton's CPU interpreter against the reference
  python -m flashattn2 explain [options]          which kernel and tile a call runs, and why

`python -m flashattn2 COMMAND --help` lists a command's options.
"""

from __future__ import annotations

import argparse
import os
import sys

RESULTS = os.path.join("bench", "results")
WHATS = ("kernels", "report", "summary", "features", "decode", "gpt", "generate", "ab", "parallel", "host", "fp8")
PROVIDERS = ("flashattn2", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "naive")
# --dtypes' names, and the torch names they may also be given by
DTYPE_NAMES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

BENCH = """The benchmark: flashattn2 beside PyTorch's SDPA backends (flash, cuDNN, efficient) and plain PyTorch, each point
checked against the reference first, appended to a CSV under bench/results/ (GPU, versions, date and git sha on
every row), then the tables and plots. It needs a CUDA GPU: without one, `bench` runs the CPU check instead
(`python -m flashattn2 check`), with --dtypes, --headdims and --causal as its filters.

WHAT:
  kernels   (default) the kernel grid: dtypes x head dims x causal x lengths x modes, each provider
  report    only rebuild the table and plots from the CSV
  summary   the README's benchmark summary from bench/results/ (--write: into README.md)
  features  what varlen, a window and the other options cost (head dim 128 by default)
  decode    GB/s of K/V read when decoding over a KV cache, eager and as a CUDA graph
  gpt       training-step TFLOP/s of GPT3-1.3B/2.7B shapes (the FlashAttention-2 paper's end-to-end table)
  generate  tokens/s of transformers' generate() beside "sdpa": eager over a left-padded prompt, and compiled with a
            static cache (--timings)
  ab        flashattn2 under two or more settings (--setting), alternated in one run
  parallel  context parallelism's per-GPU TFLOP/s: the ranks simulated on one GPU (--worlds), or under torchrun
            one rank per GPU (NCCL), beside PyTorch's context_parallel
  host      host time per call of each entry point beside SDPA's and an empty custom op (on the CPU: launches
            stubbed; into bench/results/host-<device>.csv/.md)
  fp8       the FP8 forward's TFLOP/s beside our bf16 forward and cuDNN's (--headdims, --seqlens, --causal, --rounds)

Each option says which WHAT reads it."""

CHECK = """The kernels through Triton's CPU interpreter on small shapes (forward and backward, causal and not), each
checked against an fp32 reference, beside plain PyTorch's error in the same dtype; no GPU needed, seconds a row.
It sets TRITON_INTERPRET=1 itself."""


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def _dtype_list(text: str) -> list[str]:
    """--dtypes: comma-separated fp16, bf16, fp32 (or float16, bfloat16, float32)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in DTYPE_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected some of fp16, bf16, fp32 (comma-separated), got {text!r}")
    return [DTYPE_NAMES[x] for x in names]


def _int_list(text: str) -> list[int]:
    try:
        values = _ints(text)
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, comma-separated, got {text!r}")
    return values


def _causal_list(text: str) -> list[bool]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values or set(values) - {"0", "1"}:
        raise argparse.ArgumentTypeError(f"expected 0, 1 or 0,1, got {text!r}")
    return [x == "1" for x in values]


def _parser():
    ap = argparse.ArgumentParser(
        prog="python -m flashattn2", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter
    bench = sub.add_parser("bench", help="the benchmark (the default command)", description=BENCH, formatter_class=raw)
    check = sub.add_parser(
        "check", help="the CPU check through Triton's interpreter", description=CHECK, formatter_class=raw
    )
    sub.add_parser("explain", help="the plan of a call: `python -m flashattn2 explain --help`", add_help=False)
    _bench_options(bench)
    check.add_argument(
        "--dtypes", type=_dtype_list, default=None, help="comma-separated fp16, bf16, fp32 (default: all three)"
    )
    check.add_argument(
        "--headdims",
        type=_int_list,
        default=None,
        help="comma-separated head dims: each shape runs with each (default: the shapes' own, 64, 40 and 128)",
    )
    check.add_argument("--causal", type=_causal_list, default=None, help="0, 1 or 0,1 (default: both)")
    return ap


def _bench_options(ap):
    """The benchmark's options. The filters default to None where the default depends on WHAT (said in each help)."""
    ap.add_argument(
        "what",
        nargs="?",
        default="kernels",
        choices=WHATS,
        metavar="WHAT",
        help="what to measure (above; default kernels)",
    )
    ap.add_argument(
        "--dtypes",
        type=_dtype_list,
        default=None,
        help="kernels / features / ab: comma-separated fp16, bf16 (default fp16,bf16); without a GPU, the CPU "
        "check's (fp32 too; default all three)",
    )
    ap.add_argument(
        "--headdims",
        type=_int_list,
        default=None,
        help="kernels / ab: comma-separated head dims (default 64,128); features: the last one given (default 128); "
        "without a GPU, the CPU check's",
    )
    ap.add_argument(
        "--seqlens",
        type=_int_list,
        default=None,
        help="kernels / ab: tokens per sequence, comma-separated (default 512,1024,2048,4096,8192,16384; a point "
        "holds 16k tokens: batch = 16384 / seqlen); parallel: the whole sequence's tokens (default 131072)",
    )
    ap.add_argument(
        "--causal",
        type=_causal_list,
        default=None,
        help="kernels / ab: 0 (no mask), 1 (causal) or 0,1 (default 0,1); without a GPU, the CPU check's",
    )
    ap.add_argument(
        "--modes",
        default=None,
        help="kernels / features / ab: comma-separated fwd, bwd, fwd_bwd (default all three); "
        "parallel: fwd, fwd_bwd (default both)",
    )
    ap.add_argument(
        "--providers",
        default=None,
        help=f"kernels: who runs attention, comma-separated {', '.join(PROVIDERS)} (default all; sdpa_*: "
        "torch.nn.functional.scaled_dot_product_attention with that backend; naive: plain PyTorch); decode: "
        "without an sdpa_* name, SDPA's backends are left out",
    )
    ap.add_argument("--csv", default=None, help="results CSV (appended); default bench/results/<what>-<gpu>.csv")
    ap.add_argument("--plots", default=None, help="kernels / report: folder for PNGs; default beside the CSV")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--write", action="store_true", help="summary: write it into README.md (else print it)")
    ap.add_argument("--nheads", type=int, default=None, help="kernels / ab: query heads (default 2048 / headdim)")
    ap.add_argument(
        "--nheads-k",
        type=int,
        default=None,
        help="kernels / ab: K/V heads (default nheads; fewer: GQA, e.g. --nheads 32 --nheads-k 8)",
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
        help="features: which cases (varlen, window, off, on, sinks; dv, d512, mla: bench/headdims.py; default the "
        "first five)",
    )
    ap.add_argument("--batches", default=None, help="decode: batch sizes (default 1,8,64); generate: (default 1,16)")
    ap.add_argument(
        "--caches", default="1024,8192,32768,131072", help="decode: cache lengths (default 1024,8192,32768,131072)"
    )
    ap.add_argument("--kv-heads", default="32,8", help="decode: K/V heads, 32 query heads (default 32,8)")
    ap.add_argument(
        "--layouts",
        default="contiguous,paged-16,paged-256,contiguous-unchecked",
        help="decode: flashattn2's cache layouts, contiguous and paged-<page size> (default "
        "contiguous,paged-16,paged-256,contiguous-unchecked); a suffix -unchecked times the step under "
        "set_value_checks(False), eager only: flashattn2's default setting, told apart from a --baseline's; a "
        "prefix fp8- (e.g. fp8-contiguous) reads a float8_e4m3fn cache with k_descale/v_descale",
    )
    ap.add_argument(
        "--timings",
        default="eager,graph",
        help="decode: eager and/or graph (CUDA graph replay; default both); generate: eager (a left-padded prompt, 64 "
        "new tokens) and/or graph (a static cache compiled into CUDA graphs, 256 new tokens)",
    )
    ap.add_argument("--models", default="gpt3-1.3b,gpt3-2.7b", help="gpt: model shapes (default gpt3-1.3b,gpt3-2.7b)")
    ap.add_argument("--contexts", default="2048,8192", help="gpt: context lengths (default 2048,8192)")
    ap.add_argument(
        "--attentions",
        default="flashattn2,sdpa_flash,sdpa_cudnn,naive",
        help="gpt: what runs attention (default flashattn2,sdpa_flash,sdpa_cudnn,naive)",
    )
    ap.add_argument("--tokens", type=int, default=16384, help="gpt: tokens per training step (default 16384)")
    ap.add_argument("--steps", type=int, default=10, help="gpt: timed steps after 3 warm-up steps (default 10)")
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
    ap.add_argument(
        "--worlds", default="8", help="parallel: simulated world sizes (default 8; under torchrun: its world)"
    )
    ap.add_argument(
        "--algorithms", default="zigzag,ulysses", help="parallel: zigzag, ring, ulysses (default zigzag,ulysses)"
    )
    ap.add_argument(
        "--reps", type=int, default=3, help="parallel: timed calls per point, the median reported (default 3)"
    )


def _cpu_check(argv, args) -> int:
    """The CPU check, run in a process that imported triton after TRITON_INTERPRET=1 (this one, re-executed)."""
    if args.command == "bench":
        given = [f"--{name}" for name in ("seqlens", "modes", "providers") if getattr(args, name) is not None]
        if given:
            print(
                f"bench: without a CUDA GPU, bench runs the CPU check (python -m flashattn2 check), which takes "
                f"--dtypes, --headdims and --causal, not {', '.join(given)}"
            )
            return 2
    if os.environ.get("TRITON_INTERPRET") != "1":
        # triton reads TRITON_INTERPRET when first imported, and torch may have imported it by now
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "flashattn2", *argv])
    from .bench import cpu_check

    return 0 if cpu_check.run(args.dtypes, args.headdims, args.causal or (False, True)) else 1


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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["explain"]:
        from .explain import main as explain

        return explain(argv[1:])
    if not argv or argv[0] not in ("bench", "check", "-h", "--help"):
        argv = ["bench", *argv]  # bench is the default command: `python -m flashattn2 [WHAT] [options]`
    args = _parser().parse_args(argv)
    if args.command == "check":
        return _cpu_check(argv, args)
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
    if args.what == "host":
        return _host(args, argv)
    if args.what in ("kernels", "features", "decode") and not torch.cuda.is_available():
        return _cpu_check(argv, args)
    if args.dtypes and "fp32" in args.dtypes:
        print("bench: --dtypes: the benchmark measures fp16 and bf16 (fp32 is the CPU check's)")
        return 2
    if args.what == "gpt":
        return _gpt(args)
    if args.what == "ab":
        return _ab(args)
    if args.what == "generate":
        return _generate(args)
    if args.what == "parallel":
        return _parallel(args)
    if args.what == "features":
        return _features(args)
    if args.what == "decode":
        return _decode(args)
    if args.what == "fp8":
        return _fp8(args)
    from .bench import kernels

    names = (args.providers or ",".join(PROVIDERS)).split(",")
    unknown = set(names) - set(PROVIDERS)
    if unknown:
        print(f"unknown provider(s): {sorted(unknown)}; expected some of {', '.join(PROVIDERS)}")
        return 2
    path = args.csv or _default_csv(torch.cuda.get_device_name())
    kernels.run_grid(path, _grid(args, default_rounds=1), names, progress=not args.no_progress)
    return _report(path, args.plots)


def _grid(args, default_rounds: int):
    """The kernels and ab grid from the options (their defaults where not given; --rounds' is the caller's)."""
    from .bench.kernels import Grid

    return Grid(
        dtypes=args.dtypes or ["fp16", "bf16"],
        headdims=args.headdims or [64, 128],
        seqlens=args.seqlens or [512, 1024, 2048, 4096, 8192, 16384],
        causals=args.causal or [False, True],
        modes=(args.modes or "fwd,bwd,fwd_bwd").split(","),
        nheads=args.nheads,
        nheads_k=args.nheads_k,
        rounds=args.rounds or default_rounds,
    )


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
    headdim = args.headdims[-1] if args.headdims else 128
    dtypes, modes = args.dtypes or ["fp16", "bf16"], (args.modes or "fwd,bwd,fwd_bwd").split(",")
    features.run(path, dtypes, headdim, modes, args.baseline, args.cases.split(","))
    return _write_markdown(path, features.markdown(path))


def _decode(args):
    import torch

    from .bench import decode

    path = args.csv or os.path.join(RESULTS, f"decode-{_slug(torch.cuda.get_device_name())}.csv")
    decode.run(
        path,
        decode.Grid(batches=_ints(args.batches or "1,8,64"), caches=_ints(args.caches), kv_heads=_ints(args.kv_heads)),
        args.layouts.split(","),
        args.timings.split(","),
        peers=args.providers is None or "sdpa" in args.providers,
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
        _grid(args, default_rounds=3),
        cudnn=not args.no_cudnn,
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
    grid = gpt.Grid(models=args.models.split(","), contexts=_ints(args.contexts), attentions=args.attentions.split(","))
    gpt.run(path, grid, args.tokens, args.steps)
    return _write_markdown(path, gpt.markdown(path))


def _generate(args):
    import torch

    from .bench import generate

    if not torch.cuda.is_available():
        print("bench generate measures a 1.2B-parameter model's generate(): it needs a CUDA GPU")
        return 2
    batches = _ints(args.batches or "1,16")
    ways = [{"eager": False, "graph": True}[t] for t in args.timings.split(",")]
    path = args.csv or os.path.join(RESULTS, f"generate-{_slug(torch.cuda.get_device_name())}.csv")
    generate.run(path, generate.Grid(batches=batches, compiled=ways, new_tokens=[256 if way else 64 for way in ways]))
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
    seqlens = args.seqlens or [131072]
    modes = (args.modes or "fwd,fwd_bwd").split(",")
    path = args.csv or os.path.join(RESULTS, f"parallel-{_slug(torch.cuda.get_device_name())}.csv")
    parallel.run(path, seqlens, _ints(args.worlds), args.algorithms.split(","), modes, reps=args.reps)
    return _write_markdown(path, parallel.markdown(path)) if int(os.environ.get("RANK", "0")) == 0 else 0


def _fp8(args):
    import torch

    from .bench import fp8

    if not torch.cuda.is_available():
        print("bench fp8 times the FP8 forward: it needs a CUDA GPU")
        return 2
    path = args.csv or os.path.join(RESULTS, f"fp8-{_slug(torch.cuda.get_device_name())}.csv")
    headdims, seqlens = args.headdims or [64, 128, 256], args.seqlens or [1024, 4096, 8192, 16384]
    fp8.run(path, headdims, seqlens, args.causal or [False, True], rounds=args.rounds or 3)
    return _write_markdown(path, fp8.markdown(path))


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
