#!/usr/bin/env bash
# One-shot GPU check for a single-GPU Linux machine with PyTorch + CUDA installed and no network.
# Runs in well under 8 minutes and ends with a PASS/FAIL summary:
#   1. the CUDA-marked tests (bf16 and fp16+GradScaler training, flash attention, fused AdamW, KV cache, compile)
#   2. which SDPA backend the training attention uses
#   3. throughput of the 26M and 104M presets (tokens/s, MFU, peak memory)
#   4. a short generation benchmark (KV cache vs none vs transformers, when installed)
# If $OUT is set, JSON results and logs are written there. Installs nothing; needs no network.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
declare -a NAMES RESULTS

check() {  # check NAME TIMEOUT_S COMMAND... : run, log to $OUT_DIR/NAME.log, record PASS/FAIL
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  if timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1; then RESULTS+=(PASS); else RESULTS+=("FAIL (exit $?)"); fi
  NAMES+=("$name")
  tail -n 5 "$OUT_DIR/$name.log"
}

check environment 60 "$PY" - <<'PY'
import importlib, torch
assert torch.cuda.is_available(), "CUDA is not available to PyTorch"
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(),
      "bf16", torch.cuda.is_bf16_supported())
missing = [m for m in ("numpy", "tokenizers", "safetensors", "tqdm", "pytest") if importlib.util.find_spec(m) is None]
assert not missing, f"missing Python packages: {missing}"
PY
check cuda_tests 300 env POCKETLM_REQUIRE_CUDA=1 "$PY" -m pytest -q -m cuda tests/test_cuda.py
check sdpa_backend 60 "$PY" - <<'PY'
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from model import PocketLM, get_preset
model = PocketLM(get_preset("minimind-26m")).cuda().bfloat16()
x = torch.randint(0, 6400, (4, 512), device="cuda")
chosen = None
for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
    try:
        with sdpa_kernel(backend):
            model(x)
        chosen = backend.name
        break
    except RuntimeError:
        continue
print("first SDPA backend that serves the training path:", chosen)
assert chosen == "FLASH_ATTENTION", f"expected flash attention, got {chosen}"
PY
check throughput 360 "$PY" bench/bench_train.py --presets minimind-26m minimind-104m --dtypes bfloat16 \
    --compile off --steps 20 --out "$OUT_DIR/throughput.json"
check generation 120 "$PY" bench/bench_generate.py --preset minimind-26m --new_tokens 128 \
    --out "$OUT_DIR/generation.json"

echo
echo "GPU check summary ($(date -u +%FT%TZ)); logs in $OUT_DIR"
status=0
for i in "${!NAMES[@]}"; do
  printf '  %-14s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"
  [ "${RESULTS[$i]}" = PASS ] || status=1
done
[ $status = 0 ] && echo "PASS" || echo "FAIL"
exit $status
