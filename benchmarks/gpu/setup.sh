# What the GPU scripts share (sourced, from the repository root): $OUT for logs, the wheels the GPU image
# lacks installed from .whl/ when it is there (fetch_wheels.sh), `step` to run one timed, logged command,
# and a first line naming the device and the versions.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
PY=python3
step() {  # step NAME LIMIT CMD...: run with a time limit, log to $OUT/NAME.txt, print its status and tail
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" | tee -a "$OUT/$name.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$OUT/$name.txt" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
  tail -n 25 "$OUT/$name.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
