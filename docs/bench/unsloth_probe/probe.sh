#!/usr/bin/env bash
# Unsloth on the GPU image, in one device call, from the repo root:
#   bash .carry-unsloth/probe.sh [--out DIR] [--stages bf16,4bit]
# Installs the carried packages into /tmp/site-unsloth once per machine (kept while the machine stays warm):
# site-unsloth.tar.xz is unsloth, unsloth_zoo, trl, datasets, dill, multiprocess and bitsandbytes, installed with
# `pip install --no-deps --target` by build.sh and packed; without it, the wheels in wheels/ are installed the same
# way here. Then runs probe.py with the network off (offline variables; probe.py also refuses every connection and
# lists the attempts). Exit status: probe.py's (0 = every stage passed; 1 = a stage failed; 2 = could not install).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
site=/tmp/site-unsloth
if [ ! -f "$site/.complete" ]; then
  rm -rf "$site" && mkdir -p "$site"
  if [ -f "$here/site-unsloth.tar.xz" ]; then
    tar -xJf "$here/site-unsloth.tar.xz" -C "$site" || { echo "probe.sh: could not unpack site-unsloth.tar.xz"; exit 2; }
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$here"/wheels/*.whl \
      || { echo "probe.sh: pip could not install $here/wheels/*.whl"; exit 2; }
  fi
  touch "$site/.complete"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
export UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_compiled_cache
exec python3 "$here/probe.py" "$@"
