#!/usr/bin/env bash
# FP8 frozen base, accuracy: does model.base_fp8 change what a real run learns?
#
#   bash tools/fp8_accuracy.sh OUT [SEEDS]        (SEEDS default "0 1"; needs 2 GPUs per seed, CC >= 8.9)
#   CFG=experiments/tiny-cpu.yaml EXTRA="train.max_steps=4" bash tools/fp8_accuracy.sh OUT 0   (a CPU smoke run)
#
# Setting, fixed before any FP8 run: experiments/ablation-gpu.yaml (real SmolLM2-135M-Instruct, LoRA r16 on the 7
# projections, bf16, compiled, 300 steps of 8 x 1024 on 3 Shakespeare plays) at the study's best fixed penalty
# (controller.mode=fixed, lambda 0.1: a run that settles, so a numeric difference is not amplified by the SCU's
# limit cycle). Two arms per seed, identical but for model.base_fp8: bf16 and fp8, one GPU each, all at once on one
# Ray head. Then, per seed, both adapters are scored by `python -m raytrain_scu.evaluate` on the 3 held-out plays with
# the plain bf16 base (paired bootstrap CI of fp8 - bf16). Each run's in-loop val/data_bpt (the fp8 arm's computed on
# its FP8 base) is in its output/summary.json.
set -euo pipefail
out=$(realpath -m "$1"); seeds=${2:-0 1}
cfg=${CFG:-experiments/ablation-gpu.yaml}
[ -e "$out/runs" ] && { echo "$out/runs exists: use a new OUT (its runs would resume, not start fresh)" >&2; exit 2; }
mkdir -p "$out"
# token auth unless the caller says otherwise (tests alone disable it); `ray start` does not create the token
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
[ "$RAY_AUTH_MODE" = token ] && python -m ray.scripts.scripts get-auth-token --generate > /dev/null 2>&1
ray_tmp=$(mktemp -d /tmp/rfaXXXX)  # a private temp dir: no other ray.init() on this host finds (and joins) this head
n=$(( 2 * $(wc -w <<< "$seeds") ))
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
setsid python -m ray.scripts.scripts start --head --block --node-ip-address=127.0.0.1 --port="$port" --num-gpus="$n" \
  --num-cpus=$(( 4 * n )) --include-dashboard=false --temp-dir="$ray_tmp" --disable-usage-stats > "$out/head.log" 2>&1 &
head=$!
pids=()
stop() {  # the training drivers still running, then the head's process group, then its temp dir
  for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done
  kill -TERM -- -$head 2>/dev/null; sleep 3; kill -KILL -- -$head 2>/dev/null; rm -rf "$ray_tmp"
}
trap stop EXIT
export RAY_ADDRESS=127.0.0.1:$port
up=0
for _ in $(seq 30); do
  kill -0 $head 2>/dev/null || break
  timeout 60 python -c "import ray; ray.init(log_to_driver=False)" > /dev/null 2>&1 && up=1 && break
  sleep 2
done
[ $up = 1 ] || { echo "the Ray head at $RAY_ADDRESS did not come up: see $out/head.log" >&2; exit 1; }

for seed in $seeds; do
  for arm in bf16 fp8; do
    fp8=false; [ $arm = fp8 ] && fp8=true
    python -m raytrain_scu.train $cfg seed=$seed model.base_fp8=$fp8 controller.mode=fixed controller.lambda_init=0.1 \
      scaling.cpus_per_worker=3 ${EXTRA:-} run.storage_path="$out/runs" run.name=fp8acc-$arm-s$seed \
      > "$out/train-$arm-s$seed.log" 2>&1 &
    pids+=($!)
  done
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
pids=()
unset RAY_ADDRESS
for seed in $seeds; do
  python -m raytrain_scu.evaluate --config $cfg --set seed=$seed \
    --adapter "$out/runs/fp8acc-fp8-s$seed/output/adapter" \
    --compare-adapter "$out/runs/fp8acc-bf16-s$seed/output/adapter" --json "$out/eval-s$seed.json" \
    > "$out/eval-s$seed.log" 2>&1 || rc=1
done
python - "$out" $seeds <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for seed in sys.argv[2:]:
    for arm in ("bf16", "fp8"):
        p = out / "runs" / f"fp8acc-{arm}-s{seed}" / "output" / "summary.json"
        rows[f"{arm}-s{seed}"] = json.loads(p.read_text()) if p.is_file() else "missing"
    e = out / f"eval-s{seed}.json"
    rows[f"eval-s{seed}"] = json.loads(e.read_text()) if e.is_file() else "missing"
(out / "fp8_accuracy.json").write_text(json.dumps(rows, indent=1))
print(json.dumps(rows)[:6000])
EOF
exit $rc
