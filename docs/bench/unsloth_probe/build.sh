#!/usr/bin/env bash
# Builds the Unsloth carry for the offline GPU image (CPython 3.12, torch 2.11+cu130, transformers 5.17, peft 0.21,
# triton 3.6, accelerate; see docs/unsloth.md): .carry-unsloth/ in the folder you run it from (the repo root).
#
#   bash docs/bench/unsloth_probe/build.sh            # about a minute; needs pip and PyPI
#
# It holds site-unsloth.tar.xz (the packages `import unsloth` needs that the image lacks, installed with
# `pip install --no-deps --target` and packed: ~7.1 MiB), probe.sh and probe.py (copied from beside this script),
# and MANIFEST.txt (each wheel, its size and sha256). On the GPU machine:
#   mkdir -p /tmp/site-unsloth && tar -xJf .carry-unsloth/site-unsloth.tar.xz -C /tmp/site-unsloth \
#     && export PYTHONPATH=/tmp/site-unsloth${PYTHONPATH:+:$PYTHONPATH}
# or `bash .carry-unsloth/probe.sh`, which does that and checks Unsloth end to end.
#
# Trimmed: unsloth's wheel ships its Studio web app (studio/, 82 MB unpacked) and CLI (unsloth_cli/), which the
# Python API never imports; bitsandbytes keeps only its CPU and CUDA 13.0 libraries (the image's torch is cu130).
# Pins are the set checked on the CPU against the image's package list; change them together.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${CARRY_DIR:-$PWD/.carry-unsloth}
PY=${PY:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT" "$work/dl" "$work/slim" "$work/site"
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$work/dl" \
    unsloth==2026.10.9 unsloth-zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 \
    bitsandbytes==0.50.2 ${EXTRA_WHEELS:-}
# a wheel without the members under the given prefixes, its RECORD fixed to match
slim() {
  $PY - "$@" <<'PYEOF'
import os, re, sys, zipfile
src, outdir, prefixes = sys.argv[1], sys.argv[2], tuple(sys.argv[3:])
dst = os.path.join(outdir, os.path.basename(src))
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        if info.filename.startswith(prefixes):
            continue
        data = zin.read(info.filename)
        if re.fullmatch(r"[^/]+\.dist-info/RECORD", info.filename):
            data = ("\n".join(l for l in data.decode().splitlines()
                              if not l.split(",")[0].startswith(prefixes)) + "\n").encode()
        zi = zipfile.ZipInfo(info.filename, date_time=info.date_time)
        zi.external_attr, zi.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
        zout.writestr(zi, data, compresslevel=9)
print(f"{os.path.basename(dst)}: {os.path.getsize(src)} -> {os.path.getsize(dst)} bytes")
PYEOF
}
slim "$work"/dl/unsloth-2026.10.9-*.whl "$work/slim" studio/ unsloth_cli/
slim "$work"/dl/bitsandbytes-0.50.2-*.whl "$work/slim" bitsandbytes/libbitsandbytes_cuda11 \
    bitsandbytes/libbitsandbytes_cuda12 bitsandbytes/libbitsandbytes_cuda132 bitsandbytes/libbitsandbytes_rocm \
    bitsandbytes/libbitsandbytes_xpu
for f in "$work"/dl/*.whl; do
  case $(basename "$f") in unsloth-2026*|bitsandbytes-*) ;; *) cp "$f" "$work/slim/";; esac
done
$PY -m pip install -q --no-deps --no-compile --target "$work/site" --python-version 3.12 --implementation cp \
    --only-binary=:all: $PLAT "$work"/slim/*.whl
rm -rf "$work/site/bin"
tar -C "$work/site" -cf - . | xz -T0 -9e > "$OUT/site-unsloth.tar.xz"
cp "$here/probe.sh" "$here/probe.py" "$OUT/"
(cd "$work/slim" && for f in *.whl; do echo "$(stat -c %s "$f") $(sha256sum "$f" | cut -c1-64) $f"; done) \
    > "$OUT/MANIFEST.txt"
top=$(git rev-parse --show-toplevel 2>/dev/null || true)
if [ -n "$top" ]; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.carry-unsloth/' "$exclude" 2>/dev/null || echo '/.carry-unsloth/' >> "$exclude"
fi
size=$(du -cb "$OUT"/* | tail -1 | cut -f1)
echo "$OUT: $size bytes ($((size / 1048576)) MiB) in all; the carry limit is 64 MiB for everything that travels"
cat "$OUT/MANIFEST.txt"
