#!/usr/bin/env bash
# The GPU checks and measurements, run on a GPU machine from the repository root:
#   bash benchmarks/gpu/bringup.sh PHASE...   (several phases in order; each is named by what it runs)
#   tests: the engine, model and kernel tests on CUDA   cuda-tests: the GPU's own tests only
#   graph-tests: CUDA graphs, the compiled forward and the timed forward on CUDA
#   runner: the README's job and the real shapes   decode: the decode table of both shapes
#   decode-0.6b, decode-0.6b-profiled, decode-0.6b-compiled, decode-4b, decode-4b-compiled: one shape's decode table
#   throughput-bf16, throughput-fp32: ladle vs transformers' continuous batching on the GPU
#   sweep-0.6b, sweep-4b: a chunk-size sweep of the runner
# Logs go to $OUT (or ./gpu-out): one file per phase. Wheels the machine lacks (hydra-core, omegaconf,
# xgrammar, jsonschema and what they need) are installed from .whl/ when it is there (fetch_wheels.sh).
source "$(dirname "$0")/setup.sh"
for phase in "$@"; do
  case $phase in
    tests)  # the suite with the engine and model tests on the GPU
      # -v streams each test's name and outcome, so a run cut off by its limit still names its failures.
      # The C++ CPU kernels' own tests are left out: they run on the CPU whatever the device (CI runs them).
      OMP_NUM_THREADS=1 LADLE_TEST_DEVICE=cuda step tests ${TESTS_LIMIT:-300} $PY -m pytest -v -n 15 -p no:cacheprovider \
        -rfE --durations=15 --ignore-glob='tests/kernels/test_cpu_*.py' --ignore=tests/kernels/test_huge_page_zeros.py \
        tests/engine tests/models tests/kernels
      grep -E "(FAILED|ERROR) tests/" "$OUT/tests.txt" | sort | uniq | head -80
      grep -cE "PASSED tests/" "$OUT/tests.txt" ;;
    cuda-tests)  # the GPU's own tests: the CUDA engine and the Triton kernels
      step cuda-tests 180 $PY -m pytest -q -p no:cacheprovider -rfE tests/engine/test_cuda.py tests/kernels/test_triton.py ;;
    graph-tests)  # CUDA graphs of the eager and the compiled forward (no collection during a capture; mixed
      # one-token replays equal eager), the Triton engine, the timed forward and bf16 compiled == eager
      OMP_NUM_THREADS=1 LADLE_TEST_DEVICE=cuda step graph-tests 240 $PY -m pytest -v -n 8 -p no:cacheprovider -rfE \
        tests/engine/test_cuda_graphs.py tests/engine/test_cuda.py tests/engine/test_triton_engine.py \
        tests/engine/test_timed_forward.py tests/engine/test_kv_cache_layout.py tests/engine/test_roofline_counters.py \
        tests/engine/test_chunked_prefill.py tests/models/test_compile.py ;;
    runner)  # the README's job and the real shapes, default config
      step runner 90 $PY -m runner hydra.run.dir=/tmp/run_tiny
      step runner 120 $PY -m runner model=qwen3_0_6b model.random_weights=true hydra.run.dir=/tmp/run_06b
      step runner 180 $PY -m runner model=qwen3_4b model.random_weights=true chunking.size=256 hydra.run.dir=/tmp/run_4b ;;
    decode)  # decode step time vs the HBM bound, both shapes, eager vs graphs, split-KV vs 2D attention
      step decode 300 $PY benchmarks/gpu_decode.py --models qwen3_0_6b qwen3_4b --batches 1 32 256 ;;
    decode-0.6b)
      step decode 150 $PY benchmarks/gpu_decode.py --models qwen3_0_6b --batches 1 32 256 ;;
    decode-0.6b-profiled)  # the 0.6B decode table with each batch's step phases and a profiler table at batch 1 and 32
      step decode 90 $PY benchmarks/gpu_decode.py --models qwen3_0_6b --batches 1 32 256 --skip-attention \
        --profile-batches 1 32 ;;
    decode-0.6b-compiled)  # model.compile=true: graphs of the compiled forward, profiled at batch 1
      step decode 150 $PY benchmarks/gpu_decode.py --models qwen3_0_6b --batches 1 32 --skip-attention --compile \
        --profile-batches 1 ;;
    decode-4b)
      step decode 100 $PY benchmarks/gpu_decode.py --models qwen3_4b --batches 1 32 256 --skip-attention ;;
    decode-4b-compiled)  # model.compile=true at 4B: graphs of the compiled forward against the HBM bound
      step decode 150 $PY benchmarks/gpu_decode.py --models qwen3_4b --batches 1 32 --skip-attention --compile ;;
    throughput-bf16)
      step throughput 100 $PY benchmarks/throughput_vs_transformers.py --device cuda --dtype bfloat16 \
        --num-requests 32 --median-prompt 256 --max-prompt 1024 --output-len 128 --repeats 2 --token-budget 2048 ;;
    throughput-fp32)  # fp32 on the GPU: are ladle's and transformers' greedy outputs then identical?
      step throughput 150 $PY benchmarks/throughput_vs_transformers.py --device cuda --dtype float32 \
        --num-requests 32 --median-prompt 256 --max-prompt 1024 --output-len 128 --repeats 1 --token-budget 2048 ;;
    sweep-0.6b)
      step sweep 100 $PY -m runner --multirun chunking.size=128,512,1024 model=qwen3_0_6b model.random_weights=true \
        hydra.sweep.dir=/tmp/sweep06 ;;
    sweep-4b)
      step sweep 130 $PY -m runner --multirun chunking.size=128,512,1024 model=qwen3_4b model.random_weights=true \
        hydra.sweep.dir=/tmp/sweep4b
      cat /tmp/sweep4b/sweep.md >>"$OUT/sweep.txt" 2>&1; cat /tmp/sweep4b/sweep.md ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
