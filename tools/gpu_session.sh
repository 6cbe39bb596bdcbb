#!/usr/bin/env bash
# What a session with an H100/H200 runs, stage by stage, each stage bounded so that one device call
# (10 minutes at most) can hold the stages given:  bash tools/gpu_session.sh STAGE [STAGE ...]
# Logs and CSVs go to $OUT (the device tool's folder; ./gpu-out elsewhere; plots to /tmp/gpu-plots:
# the device tool brings back 8 files a call, and `python -m flashattn2 bench report --csv FILE` redraws
# them here). From the source tree: no install needed (PYTHONPATH=src).
#
#   env        GPU, clocks, versions
#   smoke      the first stage of every session with a GPU (limit 180 s): the dense and FP8 forward/backward, the
#              KV cache, sinks, the private functions and flash_attn_gpu, SDPA, on the device's own kernels
#   tests      the whole suite but the big_memory tests (-n 14; TESTS_LIMIT seconds, 540 unless set); tests-big:
#              those, one at a time (GiBs each); rest: what `tests` runs less the smoke selection, for "smoke rest"
#              in one call (the smoke stage's compiles not repeated)
#   peer       flash_attn's own tests/test_flash_attn.py on flashattn2, sampled, seeds 0 and 1 (tools/peer; the file
#              copied from flash-attention to .devout/peer/test_flash_attn.py, einops carried as a wheel)
#   turn-tests the call path's and nothing-lost's tests at GPU sizes: threads, launches (direct relaunches checked
#              against Triton's choice), host descriptors, window edges, the private functions' dtypes, owned writes,
#              NaN propagation, the KV cache, the checkpointed MHA, and the fuzzer's CI mode
#   memcheck   compute-sanitizer memcheck over the kernel families: the owned-writes tests (dropped out-of-range
#              appends), NaN propagation, FP8 (the Gluon and Triton forwards, the FP8 cache), paged and split-KV decoding;
#              stops at the first failure unless MEMCHECK_ARGS says otherwise (MEMCHECK_ARGS= runs them all); torch's
#              caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1), so that every tensor is an allocation of its
#              own and a read or write past one is caught (in a cached segment it lands in a neighbour, unseen)
#   initcheck  compute-sanitizer initcheck (reads of memory never written) over the FP8 Gluon forward's calls
#   host-cli   python -m flashattn2 bench host with real launches beside SDPA (flash, cuDNN) and an empty custom op
#   ab-turn    bench ab against the build before the call-path turn (.devout/base: tools/baseline_pkg.py 7bad312),
#              bf16, d64/128/256, causal both, 1k/4k/16k, forward and backward, 2 rounds
#   new-tests  the GPU tests written since the last GPU run, and the paths they touch
#              (tests: ~160 s on a machine that has compiled the kernels, over 600 s on a fresh one, which compiles
#              them all: give it a call that follows another within the machine's idle release (30 s), or its own;
#              the counts go to bench/results/gpu-suite-<gpu>.md)
#   order-tests  the tests of the Gluon backward's grouped grid and of the paths it touches
#   ab-order   bench ab: the Gluon backward's grouped grid against the head-major one (bwd_order=head-major), causal,
#              fp16, every head dim and length, with cuDNN
#   ab-base-fp16 / ab-base-bf16   bench ab against a baseline package (python tools/baseline_pkg.py SHA .devout/base,
#              carried to the device): forward and backward, d64/128/256, causal both, 512-16k, 4 rounds (an even
#              number: each side first in half of them; with 3 the first setting is first in two)
#   ab-base-decode  bench decode against the same baseline, 4 alternating rounds (contiguous and paged caches)
#   ab-fwd     bench ab: the persistent forward's tiles by key length (the table's short rows) against one
#              tile at every length, fp16 and bf16
#   host       host time per call (tools/overhead.py) and a 512-token fwd+bwd beside SDPA's
#   serve-tests   the tests of serving without host syncs: no sync under set_sync_debug_mode("error") at every
#              entry point, a decode step in a CUDA graph and under torch.compile, transformers' static cache,
#              the batch-invariant mode, varlen (its cu_seqlens clamped on every call)
#   parallel-tests  flashattn2.parallel's tests at GPU sizes (the ranks simulated in one process, and gloo ranks)
#   parallel-bench  bench parallel on one GPU: zigzag ring and Ulysses at 128k tokens, 4 and 8 simulated ranks, beside
#              single-GPU flashattn2 on the per-GPU length
#   parallel-nccl1  bench parallel's torchrun path on this one GPU (a world of 1): NCCL, PyTorch's context_parallel
#   generate   bench generate: transformers' generate(), eager with a left-padded prompt and with a static cache
#              compiled into CUDA graphs, tokens/s of flashattn2 beside sdpa, batch 1 and 16
#   sdpa-tests the SDPA provider's and transformers' tests (activation reaching flashattn2's kernels)
#   decode     bench decode: the decode grid, eager and CUDA graph, beside SDPA's flash and cuDNN
#   grid-fp16 / grid-bf16   the kernel grid (bench/results/kernels-<gpu>.csv), appended; 3 rounds alternating the
#              providers (~205 s a dtype on a warm H200; one round read a point 5-10% apart in two runs)
#   grid-bwd-fp16 / grid-bwd-bf16   the grid's backward and forward + backward rows, and GQA's, appended
#   grid-fwd   the grid's forward rows only (d64/d128 fp16 and bf16, and GQA), appended
#   gqa        the GQA rows (32 query heads over 8)
#   features   bench features (varlen, window, the options' costs)
#   graph      forward + backward at 512/1k tokens with the host taken out (tools/graph_fwd_bwd.py)
#   profile    ncu of the points that miss #5's bars, beside cuDNN (tools/ncu_profile.py; summary in the log)
#   profile-causal  ncu of the d64 causal forward at 512: the table's 64(x3)x64 s4 tile, the balanced
#              64(x2)x128 (measured 0.89x the 128(x2)x64 tile it was then compared with: why?) and cuDNN
#   host-profile    where a 512-token forward + backward's host time goes (tools/host_profile.py, overhead.py --profile)
#   profile-sass    where the d256 backward's warps stall, instruction by instruction (ncu SourceCounters, tools/ncu_sass.py)
#   fp8-tests  the FP8 forward's and FP8 KV cache's tests on the device's own path (sm_90: QGMMA; the accuracy rule
#              at 2k), SDPA on flashattn2 (its .quantized ops too) and their neighbours (signatures, errors, explain)
#   fp8-race   compute-sanitizer racecheck and synccheck over the FP8 Gluon forward's calls with lengths of 1
#   fp8        bench fp8: the FP8 forward's TFLOP/s beside our bf16 forward and cuDNN's, d64/128/256, causal both,
#              1k-16k, 2 alternating rounds (the #46 goals: >= 1.0 PFLOP/s at d128/d256 non-causal 8k-16k, >= 1.3x bf16)
#   fp8-decode bench decode over an FP8 cache beside the bf16 one (contiguous and paged-256), batch 1-64, 8k-64k keys,
#              CUDA graph timing, 2 rounds (the #46 goal: <= 0.55x the bf16 step's time at bf16 reads >= 64 MiB)
#   fuzz       the fuzzer at realistic sizes for 420 s (tools/fuzz.py: random calls across the API against the reference);
#              each failure is in the log as the Case(...) that replays it
# Calls that fit the 10-minute limit (the stage limits add up to under 600 s; a fresh machine compiles
# every kernel on first use): "env new-tests"; "ab-fwd host"; "grid-fp16"; "grid-bf16"; "gqa features";
# "graph profile"; "profile-causal host-profile profile-sass"; "grid-fwd new-tests"; "env order-tests ab-order";
# "env serve-tests"; "generate"; "decode host"; "parallel-tests parallel-bench parallel-nccl1"; "env fuzz".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/.devout/base${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # (carried wheels after)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
# the sha the results record: pass FLASHATTN2_GIT_SHA (the device tool's copy of the checkout can carry
# a stale .git, which has reported an older commit)
GIT_SHA=${FLASHATTN2_GIT_SHA:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
export FLASHATTN2_GIT_SHA=$GIT_SHA
echo "results recorded as git $GIT_SHA"

# the tests added since the last GPU run and those of the paths they touch (pytest -k: one line)
NEW_TESTS="split or padded_preprocess or one_output or persistent_forward or persistent_constexprs or short_tiles"
NEW_TESTS="$NEW_TESTS or grid_limit or kernel_choice"
NEW_TESTS="$NEW_TESTS or lse_gradient or keys_past_the_end or race or ab_settings or ab_runs or plan"
NEW_TESTS="$NEW_TESTS or zero_softmax_scale or test_forward_backward or short_tile_launch or tile_text or constexprs"
# the smoke stage's selection (~130 tests on the CPU, 634 on an H100: each kernel family once, fp16 where the dtypes
# repeat): a fresh machine compiles every kernel it runs, and the whole modules (550 tests) took over 500 s there
SMOKE_TESTS="(test_forward_backward and fp16) or test_lengths_of_one or (test_gluon_forward and True and not many-tiles)"
SMOKE_TESTS="$SMOKE_TESTS or (test_kvcache and float16 and not bfloat16) or test_splits_match_no_split or test_sinks"
SMOKE_TESTS="$SMOKE_TESTS or test_kvcache_with_a_sink or test_forward_backward_against_reference or test_varlen_forward or flash_attn_gpu"
SMOKE_TESTS="$SMOKE_TESTS or test_private_functions or test_sdpa_op_forward_backward or test_flash_op_dense_options"
SMOKE_TESTS="$SMOKE_TESTS or test_paged_call_past_its_pages_raises"
SMOKE_FILES=(tests/test_attention.py tests/test_fp8.py tests/test_kvcache.py tests/test_kvcache_errors.py tests/test_sinks.py
  tests/test_flash_attn_interface.py tests/test_sdpa.py)
# the Gluon backward's grouped grid (and the tests of the paths it touches)
ORDER_TESTS="grid_order or many_heads or key_blocks_limit or grid_rule or split_ring or plans_repeated or persistent_forward_tiles"
ORDER_TESTS="$ORDER_TESTS or short_tile_launch or lse_gradient or one_output or race"

stage() {  # stage NAME SECONDS COMMAND...: run COMMAND with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s) $(date +%T)"
  local start=$SECONDS
  # SIGINT first: pytest stopped at its limit still prints its counts and failures so far
  timeout -s INT -k 30 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc in $((SECONDS - start))s"
  tail -n 25 "$OUT/$name.log"
}

for s in "$@"; do
  case $s in
    env)
      stage env 30 bash -c 'nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,memory.used --format=csv;
        python3 -c "import torch, triton, numpy; print(torch.__version__, triton.__version__, numpy.__version__,
        torch.cuda.get_device_name(), torch.cuda.get_device_capability(), \"registry:\",
        [n for n in dir(__import__(\"torch.nn.attention\").nn.attention) if n.endswith(\"flash_attention_impl\")])"' ;;
    new-tests)
      stage new-tests 240 python3 -m pytest -n 14 -q -p no:cacheprovider tests/test_attention.py tests/test_plan_choice.py tests/test_bench.py \
        -k "$NEW_TESTS" ;;
    turn-tests)
      stage turn-tests 420 python3 -m pytest -n 14 -q -p no:cacheprovider tests/test_threads.py tests/test_launch.py \
        tests/test_owned_writes.py tests/test_nan.py tests/test_fuzz.py tests/test_kvcache.py tests/test_kvcache_errors.py tests/test_mha.py \
        tests/test_flash_attn_interface.py tests/test_features.py tests/test_transformers.py \
        tests/test_attention.py::test_host_descriptor_rule ;;
    smoke)
      stage smoke 180 python3 -m pytest -n 14 -q -p no:cacheprovider -m "not big_memory" "${SMOKE_FILES[@]}" \
        -k "$SMOKE_TESTS" ;;
    rest)  # the rest of `tests` after `smoke` in the same call: the smoke files less its selection, then the others
      stage rest "${TESTS_LIMIT:-540}" bash -c 'f=("${@:2}"); python3 -m pytest -n 14 -q -p no:cacheprovider -m "not big_memory" \
        "${f[@]}" -k "not ($1)"; a=$?; python3 -m pytest -n 14 -q -p no:cacheprovider -m "not big_memory" \
        --deselect tests/test_compile_targets.py "${f[@]/#/--ignore=}"; b=$?; exit $((a > b ? a : b))' \
        rest "$SMOKE_TESTS" "${SMOKE_FILES[@]}" ;;
    memcheck)
      stage memcheck 540 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 -m pytest -q -p no:cacheprovider \
        tests/test_owned_writes.py tests/test_nan.py tests/test_fp8.py tests/test_fp8_kvcache.py \
        "tests/test_kvcache_errors.py::test_paged_call_past_its_pages_raises" -k "not long_cache" ${MEMCHECK_ARGS--x} ;;
    initcheck)  # compute-sanitizer initcheck: device memory read before anything wrote it (INITCHECK_K: which tests)
      stage initcheck 300 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --error-exitcode 9 \
        python3 -m pytest -q -p no:cacheprovider \
        tests/test_fp8.py -k "${INITCHECK_K:-test_gluon_forward and (ones or descales)}" ;;
    fp8-race)  # the FP8 Gluon forward's smallest calls (lengths of 1) under racecheck and synccheck
      stage fp8-race 200 bash -c "for tool in racecheck synccheck; do compute-sanitizer --tool \$tool --error-exitcode 9 \
          python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py -k 'test_gluon_forward and ones' || exit; done" ;;
    fp8-tests)
      stage fp8-tests 300 python3 -m pytest -n 8 -q -p no:cacheprovider tests/test_fp8.py tests/test_fp8_kvcache.py \
        tests/test_sdpa.py tests/test_signatures.py tests/test_errors.py tests/test_explain.py ;;
    fp8)
      stage fp8 300 python3 -m flashattn2 bench fp8 --csv "$OUT/fp8.csv" --rounds 2 ;;
    fp8-decode)
      stage fp8-decode 200 python3 -m flashattn2 bench decode --csv "$OUT/fp8-decode.csv" --providers flashattn2 \
        --layouts contiguous,fp8-contiguous,paged-256,fp8-paged-256 --batches 1,8,64 --caches 8192,65536 \
        --kv-heads 8 --timings graph --rounds 2 ;;
    host-cli)
      stage host-cli 240 python3 -m flashattn2 bench host --csv "$OUT/host.csv" ;;
    ab-turn)
      stage ab-turn 560 python3 -m flashattn2 bench ab --csv "$OUT/ab-turn.csv" --modes fwd,bwd --rounds 2 --no-progress \
        --no-cudnn --setting default --setting pkg:flashattn2_base --dtypes bf16 --headdims 64,128,256 \
        --seqlens 1024,4096,16384 --causal 0,1 ;;
    order-tests)
      stage order-tests 240 python3 -m pytest -n 14 -q -p no:cacheprovider tests/test_attention.py tests/test_plan_choice.py tests/test_protocol_model.py \
        -k "$ORDER_TESTS" ;;
    ab-order)
      stage ab-order 300 python3 -m flashattn2 bench ab --csv "$OUT/ab.csv" --modes bwd --rounds 3 --no-progress \
        --setting default --setting bwd_order=head-major --dtypes fp16 --headdims 256,128,64 \
        --seqlens 512,1024,2048,4096,8192,16384 --causal 1 ;;
    tests)
      stage tests "${TESTS_LIMIT:-540}" python3 -m pytest -n 14 -q -p no:cacheprovider -m "not big_memory" \
        --deselect tests/test_compile_targets.py ;;
    peer)
      stage peer 420 env SEEDS="${SEEDS:-0 1}" PEER_LIMIT=200 bash tools/peer/run.sh .devout/peer/test_flash_attn.py ;;
    tests-big)
      stage tests-big 540 python3 -m pytest -q -p no:cacheprovider -m big_memory ;;
    ab-base-fp16|ab-base-bf16)
      stage "$s" 590 python3 -m flashattn2 bench ab --csv "$OUT/ab-base.csv" --modes fwd,bwd --rounds 4 --no-progress \
        --no-cudnn --setting default --setting pkg:flashattn2_base --dtypes "${s#ab-base-}" --headdims 64,128,256 \
        --seqlens 512,1024,2048,4096,8192,16384 --causal 0,1 ;;
    ab-base-decode)
      stage ab-base-decode 400 python3 -m flashattn2 bench decode --csv "$OUT/decode-base.csv" --baseline flashattn2_base \
        --rounds 4 --providers flashattn2 --layouts contiguous,paged-16,paged-256 ;;
    ab-fwd)
      stage ab-fwd 300 bash -c "python3 -m flashattn2 bench ab --csv '$OUT/ab.csv' --modes fwd --rounds 3 --no-progress \
          --setting default --setting fwd_hopper_persist=64x128w12s3 --setting fwd_hopper_persist=128x64w8s2 \
          --dtypes fp16,bf16 --headdims 64 --seqlens 512,2048,16384 --causal 0,1 &&
        python3 -m flashattn2 bench ab --csv '$OUT/ab.csv' --modes fwd --rounds 3 --no-progress \
          --setting default --setting fwd_hopper_persist=64x128w8s2 --dtypes fp16,bf16 --headdims 128 \
          --seqlens 512,1024,2048,4096 --causal 1" ;;
    serve-tests)
      stage serve-tests 400 python3 -m pytest -n 14 -q -p no:cacheprovider tests/test_no_sync.py tests/test_kvcache.py tests/test_kvcache_errors.py \
        tests/test_transformers.py tests/test_batch_invariant.py tests/test_varlen.py tests/test_launch.py ;;
    parallel-tests)
      stage parallel-tests 300 python3 -m pytest -n 8 -q -p no:cacheprovider tests/test_parallel.py tests/test_layout.py ;;
    parallel-bench)
      stage parallel-bench 200 python3 -m flashattn2 bench parallel --worlds 4,8 --seqlens 131072 \
        --csv "$OUT/parallel.csv" ;;
    parallel-nccl1)
      # the torchrun path (NCCL, PyTorch's context_parallel beside) on this one GPU: a world of 1
      stage parallel-nccl1 150 python3 -m torch.distributed.run --nproc-per-node 1 -m flashattn2 bench parallel \
        --seqlens 16384 --csv "$OUT/parallel-nccl1.csv" ;;
    generate)  # GENERATE_TIMINGS: eager (~100 s), graph (compiles four models: ~400 s) or both
      stage generate 500 python3 -m flashattn2 bench generate --csv "$OUT/generate.csv" \
        --timings "${GENERATE_TIMINGS:-eager,graph}" ;;
    sdpa-tests)
      stage sdpa-tests 200 python3 -m pytest -n 14 -q -p no:cacheprovider tests/test_sdpa.py tests/test_transformers.py ;;
    decode)
      stage decode 400 python3 -m flashattn2 bench decode --csv "$OUT/decode.csv" ;;
    host)
      stage host 240 bash -c "python3 tools/overhead.py &&
        python3 -m flashattn2 bench --csv '$OUT/host.csv' --plots /tmp/gpu-plots --no-progress --dtypes fp16,bf16 --headdims 128,64 \
          --seqlens 512 --causal 0,1 --modes fwd,bwd,fwd_bwd --providers flashattn2,sdpa_flash,sdpa_cudnn" ;;
    grid-fp16|grid-bf16)
      stage "$s" 560 python3 -m flashattn2 bench --csv "$OUT/kernels.csv" --plots /tmp/gpu-plots --no-progress --dtypes "${s#grid-}" \
        --headdims 64,128,256 --providers flashattn2,sdpa_flash,sdpa_cudnn --rounds 3 ;;
    grid-bwd-fp16|grid-bwd-bf16)  # the backward and forward + backward rows (every head dim) and GQA's
      stage "$s" 560 bash -c "python3 -m flashattn2 bench --csv '$OUT/kernels.csv' --plots /tmp/gpu-plots --no-progress \
          --dtypes ${s#grid-bwd-} --headdims 64,128,256 --modes bwd,fwd_bwd --providers flashattn2,sdpa_flash,sdpa_cudnn --rounds 3 &&
        python3 -m flashattn2 bench --csv '$OUT/kernels.csv' --plots /tmp/gpu-plots --no-progress --dtypes ${s#grid-bwd-} \
          --headdims 128 --nheads 32 --nheads-k 8 --modes bwd,fwd_bwd --providers flashattn2,sdpa_flash,sdpa_cudnn --rounds 3" ;;
    grid-fwd)  # the forward rows only (d64/d128, both dtypes, and GQA): ~80 s on a warm H200
      stage grid-fwd 200 bash -c "python3 -m flashattn2 bench --csv '$OUT/kernels.csv' --plots /tmp/gpu-plots --no-progress \
          --dtypes fp16,bf16 --headdims 64,128 --modes fwd --providers flashattn2,sdpa_flash,sdpa_cudnn &&
        python3 -m flashattn2 bench --csv '$OUT/kernels.csv' --plots /tmp/gpu-plots --no-progress --dtypes fp16,bf16 \
          --headdims 128 --nheads 32 --nheads-k 8 --modes fwd --providers flashattn2,sdpa_flash,sdpa_cudnn" ;;
    gqa)
      stage gqa 280 python3 -m flashattn2 bench --csv "$OUT/kernels.csv" --plots /tmp/gpu-plots --no-progress --dtypes fp16,bf16 \
        --headdims 128 --nheads 32 --nheads-k 8 --providers flashattn2,sdpa_flash,sdpa_cudnn ;;
    features)
      stage features 300 python3 -m flashattn2 bench features --csv "$OUT/features.csv" --dtypes fp16,bf16 ;;
    graph)
      stage graph 150 python3 tools/graph_fwd_bwd.py ;;
    profile)
      stage profile 240 bash -c "ncu --profile-from-start off --clock-control none --section SpeedOfLight \
          --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats \
          --section LaunchStats --section Occupancy --print-details all python3 tools/ncu_profile.py \
          flashattn2:fp16:64:1:512 sdpa_cudnn:fp16:64:1:512 flashattn2:fp16:64:1:2048 sdpa_cudnn:fp16:64:1:2048 \
          flashattn2:fp16:128:1:512 sdpa_cudnn:fp16:128:1:512 flashattn2:fp16:256:0:4096:bwd \
          sdpa_cudnn:fp16:256:0:4096:bwd > '$OUT/ncu.txt' 2>&1 && python3 tools/ncu_profile.py --summarize '$OUT/ncu.txt'" ;;
    profile-causal)
      stage profile-causal 150 bash -c "ncu --profile-from-start off --clock-control none --section SpeedOfLight \
          --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats \
          --section LaunchStats --section Occupancy --print-details all python3 tools/ncu_profile.py \
          flashattn2:fp16:64:1:512 flashattn2:fp16:64:1:512:fwd_hopper_persist=64x128w8s2 sdpa_cudnn:fp16:64:1:512 \
          > '$OUT/ncu-causal.txt' 2>&1 && python3 tools/ncu_profile.py --summarize '$OUT/ncu-causal.txt'" ;;
    host-profile)
      stage host-profile 90 bash -c "python3 tools/host_profile.py --shape 32,512,16,128 --causal 1 --rows 40 &&
        python3 tools/overhead.py --profile '$OUT/host-profile.txt'" ;;
    profile-sass)
      stage profile-sass 150 bash -c "ncu --profile-from-start off --clock-control none --kernel-name regex:attn_bwd_ws \
          --section WarpStateStats --section SourceCounters --import-source no -o /tmp/sass-rep -f python3 tools/ncu_profile.py \
          flashattn2:fp16:256:0:4096:bwd && ncu -i /tmp/sass-rep.ncu-rep --page source --csv --print-source sass > /tmp/sass.csv &&
          gzip -c /tmp/sass.csv > '$OUT/sass.csv.gz' && python3 tools/ncu_sass.py /tmp/sass.csv" ;;
    fuzz)
      stage fuzz 540 python3 tools/fuzz.py --seconds 420 --device cuda ;;
    *)
      echo "unknown stage $s"; exit 2 ;;
  esac
done
