"""The suite's two tiers on the CPU. The first (`python -m pytest`, the README's command: minutes on two cores) runs
every public function, every kernel family through the interpreter and every bad-input test; the second
(`python -m pytest -m slow`, which .ci/run runs after the first) runs what costs minutes and repeats the first tier's
coverage at other shapes, dtypes and options, and what starts processes of its own.

One table decides: a test whose node id matches a pattern (re.search) is marked `slow`. Each row says why it can
wait and what in the first tier covers its code; the seconds are one worker's on a 2-core machine (triton 3.6,
`pytest --durations`). On a GPU both tiers run (conftest.py deselects on the CPU only)."""

import re

SECOND_TIER = {
    # a subprocess per part compiling every kernel the table can select for sm_90/80/86/89: 1,160 s in all
    r"test_compile_targets\.py::": "no interpreter run covers it; the compile targets are the second tier's core",
    # 40 s of random calls; test_fuzz (10 s) samples the same generator in the first tier
    r"test_fuzz\.py::test_fuzz_long": "the long fuzz",
    # gloo ranks in subprocesses (67 s), and torchrun's two ranks of the example (35 s): the simulated group's
    # tests run the same ring and Ulysses code in one process in the first tier
    r"test_parallel\.py::test_gloo_ranks": "processes of their own",
    r"test_examples\.py::test_gpt_example_context_parallel": "processes of their own",
    r"test_readme\.py::test_shell_block_runs_as_printed": "processes of their own (the example, torchrun)",
    # the larger world (3 ranks, 2 sequences: 60 s) of the ring and zigzag rows whose 2-rank rows run first; mixed
    # documents (16 s) where one-document rows run first
    r"test_parallel\.py::test_dense_matches_the_reference\[w3-[^]]*-(ring|zigzag)-": "a larger world",
    r"test_parallel\.py::test_varlen_matches_each_document_alone\[mixed-(ring|zigzag)": "more documents",
    # the mode's prefill/decode agreement at its other shapes and options (140 s): h2-hk2-d128 with a softcap,
    # ALiBi and a sink runs first, as the fp32 GQA entry points do
    r"test_batch_invariant\.py::test_(prefill_and_decode_agree|decode_alone_and_in_a_batch)\[(?!h2-hk2-d128-softcap)": (
        "other shapes and options"
    ),
    r"test_batch_invariant\.py::test_entry_points_agree_with_decode\[(?!fp32-gqa)": "other dtypes and head dims",
    # the dense forward/backward's bf16 and fp32 rows (97 s): fp16 runs every shape and path first, bf16 runs in the
    # README's first call, the KV cache's and the SDPA tests
    r"test_attention\.py::test_forward_backward\[[^]]*-(bf16|fp32)-": "other dtypes",
    # the program order that runs every head's first block first (38 s); head-by-head runs first
    r"test_attention\.py::test_causal_block_orders\[all-heads-first\]": "the other block order",
    # the features' single-option rows on the TMA path with mixed tiles (60 s): their combinations run there first,
    # and every single option on the pointer path
    r"test_features\.py::test_features\[(?![^]]*softcap-alibi)[^]]*-tma-mixed-tiles\]": (
        "single options on the second path"
    ),
    # 200 training steps of the example GPT (25 s): its forward/backward and decode steps are tests of their own
    r"test_gpt\.py::test_training_lowers_the_loss": "a training run",
}

# any row's pattern: the second tier's tests (conftest.py marks them, tests/test_tiers.py checks the rows)
SLOW = re.compile("|".join(f"(?:{pattern})" for pattern in SECOND_TIER))
