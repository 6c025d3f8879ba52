#!/bin/bash
# Everything shardfx checks and measures on one GPU, in one go, each part under a time limit,
# so a short lease on a GPU machine gives every number it can: the CUDA tests, then
# bench/gpu.py (nanoGPT in fp32 and bf16 against eager and torch.compile, then a Hugging Face
# Llama in bf16), then bench/kernels.py (the fused Triton kernels), then bench/offload_gpu.py
# (activation offload on a 1.1B Llama; the deepest model a capped GPU trains with the
# optimizer offloaded). Each part's log goes to
# $OUT (default /tmp/gpu-session) and the tables the benches append to bench/RESULTS.md are
# copied there as results.diff. A part cut off by its limit still leaves what it printed:
# bench/gpu.py says each row's step time as it goes.
#
#     bash bench/gpu_session.sh                  # about 11 minutes on an H200
#     T_LLAMA=400 bash bench/gpu_session.sh      # a limit per part: T_TEST T_NANOGPT T_LLAMA T_KERNELS T_OFFLOAD
#
# Runs with the machine's own python3 and PyTorch; wheels in .whl/ (Liger-Kernel for
# bench/kernels.py's comparison) are installed to /tmp/site first.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
cp bench/RESULTS.md "$OUT/RESULTS.before"

part() {  # part NAME LIMIT COMMAND...: run it, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - start)) s (limit $limit s)"
  grep -E "^\||passed|failed|: step|did not run|WARNING" "$OUT/$name.log" | tail -40
}
part test_cuda "${T_TEST:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -rfE
part gpu_nanogpt "${T_NANOGPT:-150}" python3 -m bench.gpu --models nanogpt --warmup 2 --steps 5
part gpu_llama "${T_LLAMA:-240}" python3 -m bench.gpu --models llama --precisions bf16 \
  --warmup 2 --steps 5
part kernels "${T_KERNELS:-150}" python3 -m bench.kernels --no-step
part offload "${T_OFFLOAD:-200}" python3 -m bench.offload_gpu --warmup 1 --steps 5
diff "$OUT/RESULTS.before" bench/RESULTS.md > "$OUT/results.diff"
exit 0
