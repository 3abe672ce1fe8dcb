#!/usr/bin/env bash
# One-shot GPU check for a single-GPU Linux machine with PyTorch + CUDA installed and no network.
# Ends with a PASS/FAIL summary within a fixed time budget (GPU_CHECK_BUDGET_S, default 420 s, leaving margin
# under 8 minutes for start-up and the summary):
#   1. environment: CUDA visible to PyTorch, bf16 support, the Python packages the repo needs
#   2. the CUDA-marked tests (bf16, fp16+GradScaler and fp32/TF32 training, flash attention, fused AdamW, KV cache, compile)
#   3. which SDPA backend serves the training attention (flash expected)
#   4. throughput of the 26M, 26M-MoE (vs dense at equal active parameters) and 104M presets (tokens/s, MFU, memory)
#   5. a short generation benchmark (KV cache vs none vs transformers, when installed)
#   6. python -m model --plan's table for a 2-hour budget, and a 60 s --preset auto run of the demo recipe (planned,
#      then trained in its budget)
# If $OUT is set, results go there: gpu_check.log (every check's output), summary.json, throughput.json and
# generation.json. Installs nothing; needs no network. Without a GPU it stops after the environment check.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
rm -f "$OUT_DIR"/{summary,throughput,generation}.json  # never report a previous run's numbers
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-420}
# A check past its limit gets SIGTERM, then SIGKILL this much later. SIGTERM alone is not enough: the trainer
# turns it into "checkpoint and exit 0", and a hung CUDA call may not return to handle it at all.
KILL_GRACE_S=10
NAMES=() RESULTS=() SECONDS_TAKEN=()
ABORT=""  # set when a failure makes the remaining checks pointless

check() {  # check NAME LIMIT_S COMMAND... : run within the remaining budget, log, record PASS/FAIL/SKIPPED
  local name=$1 limit=$2 result started=$SECONDS; shift 2
  local left=$((BUDGET_S - SECONDS - KILL_GRACE_S))
  ((left < limit)) && limit=$left
  if ((limit <= 0)); then
    result="SKIPPED (time budget of ${BUDGET_S}s spent)"
  elif [ -n "$ABORT" ]; then
    result="SKIPPED ($ABORT)"
  else
    echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local part="$OUT_DIR/.$name.part"
    timeout -k "$KILL_GRACE_S" "$limit" "$@" > "$part" 2>&1
    local rc=$?
    cat "$part" >> "$LOG"
    tail -n 8 "$part"
    rm -f "$part"
    if [ $rc = 0 ]; then result=PASS
    elif [ $rc = 124 ] || [ $rc = 137 ]; then result="FAIL (timed out after ${limit}s)"
    else result="FAIL (exit $rc)"; fi
  fi
  NAMES+=("$name") RESULTS+=("$result") SECONDS_TAKEN+=($((SECONDS - started)))
  [ "$result" = PASS ]
}

check environment 60 "$PY" - <<'PY' || ABORT="no usable CUDA environment"
import importlib.util, torch
missing = [m for m in ("numpy", "tokenizers", "safetensors", "tqdm", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    raise SystemExit(f"missing Python packages: {missing}")
if not torch.cuda.is_available():
    raise SystemExit(f"CUDA is not available to PyTorch {torch.__version__}")
from trainer_utils.runtime import compile_toolchain_problem
# the compile tests would fail deep in a compile worker without a compiler or Python's headers: say it once
print("torch.compile toolchain:", compile_toolchain_problem() or "ok (a C/C++ compiler and Python.h)")
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(),
      "bf16", torch.cuda.is_bf16_supported(), "transformers",
      "yes" if importlib.util.find_spec("transformers") else "no (generation check skips the comparison)")
PY
check cuda_tests 240 env POCKETLM_REQUIRE_CUDA=1 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py
check sdpa_backend 60 "$PY" - <<'PY'
# Which SDPA kernel PyTorch actually dispatches (no sdpa_kernel forcing): a profiled training step (fp32 weights,
# bf16 autocast, forward + backward) and bf16 KV-cache decoding, each named by its aten op.
import torch
from torch.profiler import ProfilerActivity, profile
from model import PocketLM, get_preset
from model.generate import generate
from model.inference import resolve_device

resolve_device("cuda")  # the policy every command applies (model.model.set_attention_policy: no cuDNN attention)
def kernels(fn):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")})
model = PocketLM(get_preset("minimind-26m")).cuda()
x = torch.randint(0, 6400, (4, 512), device="cuda")
def train_step():
    with torch.autocast("cuda", torch.bfloat16):
        model(x).float().logsumexp(-1).mean().backward()
train_step()
training = kernels(train_step)
print("training step (bf16 autocast):", training)
bf16 = PocketLM(get_preset("minimind-26m")).cuda().bfloat16().eval()
prompts = [[1, 2, 3, 4] * 8, [5, 6, 7] * 5]  # two lengths: a left-padded batch, as eval_model and serving decode
decode = kernels(lambda: generate(bf16, prompts, max_new_tokens=32, temperature=0.0, pad_token_id=0))
print("bf16 KV-cache decoding:", decode)
if not any("flash" in k for k in training):
    raise SystemExit(f"expected flash attention in training, got {training}")
if any("cudnn" in k for k in training + decode):
    raise SystemExit("cuDNN attention was dispatched despite the policy")
PY
check throughput 240 "$PY" bench/bench_train.py --presets minimind-26m minimind-26m-moe minimind-104m --dtypes bfloat16 \
    --compile off --optimizers adamw --min_seconds 3 --out "$OUT_DIR/throughput.json"
check generation 90 "$PY" bench/bench_generate.py --preset minimind-26m --new_tokens 128 \
    --out "$OUT_DIR/generation.json"
check plan 90 "$PY" -m model --plan --time_budget 2h --device cuda
check time_budget 90 "$PY" train_pretrain.py --config recipes/demo-pretrain.yaml --preset auto --device cuda --time_budget 60s \
    --max_steps 100000 --out_dir "$(mktemp -d)" --run_name gpu-check-budget

# The summary: each check's result and time, then the headline numbers, also as summary.json.
"$PY" bench/gpu_check_summary.py "$OUT_DIR" "$BUDGET_S" "${NAMES[@]}" -- "${RESULTS[@]}" -- "${SECONDS_TAKEN[@]}"
rc=$?
if ((rc > 1)); then  # the summary itself could not run (no usable Python): report in plain shell
  for i in "${!NAMES[@]}"; do printf '  %-14s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
  echo FAIL
  exit 1
fi
exit $rc
