#!/usr/bin/env bash
# What chunked prefill costs and buys on a GPU, measured in two calls of under ten minutes each (H100/H200),
# from the repository root, with the wheels of fetch_wheels.sh in .whl/:
#   bash benchmarks/gpu/chunked_prefill.sh steps    # ~6 min: mixed-graph tests on CUDA, matmul peak, the
#                                                   # mixed step (512-token chunk + 32 decodes, 4B) against
#                                                   # its kernel time, decode at batch 1 and 32 (4B) against
#                                                   # the HBM bound, the 0.6B sweep on gpu_long_documents
#   bash benchmarks/gpu/chunked_prefill.sh sweeps   # ~8 min: the 4B sweep on gpu_long_documents, offline
#                                                   # throughput on 1,000 ShareGPT-like prompts (0.6B, 4B)
#                                                   # against transformers' continuous batching
# Each step has its own time limit and logs to $OUT/<step>.txt; JSON results land in $OUT too. A step cut
# off by its limit leaves the others running.
source "$(dirname "$0")/setup.sh"
sweep() {  # sweep MODEL LIMIT: chunk sizes 256..2048 and unchunked on the long-document workload
  local model=$1 limit=$2 dir=/tmp/sweep-$1
  step "sweep-$model" "$limit" $PY -m ladle --multirun model="$model" model.random_weights=true \
    experiment=gpu_long_documents cache.max_model_len=32800 output.progress=false \
    chunking.size=256,512,1024,2048 hydra.sweep.dir="$dir"
  step "sweep-$model-off" $((limit / 3)) $PY -m ladle model="$model" model.random_weights=true \
    experiment=gpu_long_documents cache.max_model_len=32800 output.progress=false chunking=off \
    hydra.run.dir="$dir/off"
  cat "$dir/sweep.md" "$dir/off/summary.json" >>"$OUT/sweep-$model.txt" 2>&1
}
case ${1:-} in
  steps)
    LADLE_TEST_DEVICE=cuda step graph-tests 90 $PY -m pytest -q -p no:cacheprovider -rfE \
      tests/engine/test_cuda_graphs_mixed.py tests/engine/test_cuda_graphs.py
    step mixed-step 90 $PY benchmarks/gpu/chunked_prefill.py peak mixed-step --out "$OUT"
    step decode 90 $PY benchmarks/gpu_decode.py --models qwen3_4b --batches 1 32 --skip-attention
    sweep qwen3_0_6b 150 ;;
  sweeps)
    sweep qwen3_4b 270
    step throughput 200 $PY benchmarks/gpu/chunked_prefill.py throughput --model qwen3_0_6b --out "$OUT"
    step throughput 200 $PY benchmarks/gpu/chunked_prefill.py throughput --model qwen3_4b --out "$OUT" ;;
  *) echo "usage: $0 steps|sweeps" >&2; exit 2 ;;
esac
