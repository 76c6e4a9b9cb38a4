#!/usr/bin/env bash
# One GPU call of the Mamba kernel probe, run from the repo root of the checkout the device tool sends, with the folder of
# this script carried (.carry-kernels/: the sdists, build_mamba_wheels.sh, mamba_probe.py, bnb/, maybe wheels/):
#   bash .carry-kernels/mamba_device_run.sh STEP...      (BUDGET=seconds for the whole call, default 560)
# Steps: a probe phase with its arguments, joined by ':' (e.g. bench:--batch:8:--block:2048), each started only if
# its minimum time is left. First, once per machine: the kernels are installed into /tmp/kern -- from
# .carry-kernels/wheels/ when built before, else built here (mamba-ssm first, then, while causal-conv1d's CUDA
# extension compiles, mamba_ssm's Triton kernels are JIT-compiled into Triton's cache in the background).
set -u
K=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${BUDGET:-560}
SITE=/tmp/kern
export PYTHONUNBUFFERED=1 PROBE_OUT=$OUT/results.jsonl MAX_JOBS=${MAX_JOBS:-16}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
say() { echo "== [$(($(date +%s) - T0)) s] $*"; }

export PATH=$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH  # pip's ninja: parallel nvcc
say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
say "ninja $(ninja --version 2>&1); $(nvcc --version | tail -2 | head -1); $(python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)')"

if [ ! -f $SITE/.ok ]; then
  if [ -z "${REBUILD:-}" ] && ls "$K"/wheels/causal_conv1d-*.whl "$K"/wheels/mamba_ssm-*.whl >/dev/null 2>&1; then
    say "installing the carried wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "$K"/wheels/causal_conv1d-*.whl \
      "$K"/wheels/mamba_ssm-*.whl || exit 1
  else
    mkdir -p /tmp/wheels
    say "building mamba-ssm (Triton-only)"
    BUILD_ONLY=mamba_ssm bash "$K"/build_mamba_wheels.sh "$K"/sdist /tmp/wheels $SITE >"$OUT"/build.log 2>&1 \
      || { tail -40 "$OUT"/build.log; exit 1; }
    (for d in bf16 fp32; do PYTHONPATH=$SITE timeout 400 python3 "$K"/mamba_probe.py warm $d; done) \
      >"$OUT"/warm.log 2>&1 &
    warm=$!
    say "building causal-conv1d (CUDA sm_90), Triton warm-up in the background"
    BUILD_ONLY=causal_conv1d bash "$K"/build_mamba_wheels.sh "$K"/sdist /tmp/wheels $SITE >>"$OUT"/build.log 2>&1 \
      || { tail -60 "$OUT"/build.log; exit 1; }
    grep -E "^built|^-rw" "$OUT"/build.log
    # $OUT takes files of at most 16 MiB named in [A-Za-z0-9._-] only: the causal-conv1d wheel is 24.7 MiB and wheel
    # names carry a '+' (local version), so both travel back as one tar in 15 MiB parts. Here:
    #   mkdir -p .carry-kernels/wheels && cat FILES_AT/kernel_wheels.tar.part_* | tar -xf - -C .carry-kernels/wheels
    (cd /tmp/wheels && sha256sum ./*.whl && tar -cf - ./*.whl | split -b 15m - "$OUT"/kernel_wheels.tar.part_)
    say "waiting for the warm-up"
    wait $warm
    grep -E "RESULT|Error|error" "$OUT"/warm.log | cut -c1-300
  fi
  if ls "$K"/bnb/bitsandbytes-*.whl >/dev/null 2>&1; then  # for the 4-bit run only
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "$K"/bnb/bitsandbytes-*.whl || true
  fi
  touch $SITE/.ok
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

for step in "$@"; do
  IFS=: read -r -a args <<<"$step"
  case ${args[0]} in
    check) need=20 ;; corr) need=150 ;; qlora) need=100 ;; *) need=70 ;;
  esac
  [[ "$step" == *compile:layers* ]] && need=150
  if [ "$(left)" -lt $need ]; then
    say "SKIP (only $(left) s left): $step"
    echo "{\"phase\": \"skipped\", \"step\": \"$step\"}" >>"$PROBE_OUT"
    continue
  fi
  say "$step"
  timeout -k 5 $(($(left) - 5)) python3 "$K"/mamba_probe.py "${args[@]}" >>"$OUT"/probe.log 2>&1
  rc=$?
  [ $rc -ne 0 ] && { say "rc=$rc: $step"; tail -25 "$OUT"/probe.log; }
done
say "summary"
python3 "$K"/mamba_probe.py summary 2>/dev/null | cut -c1-400
