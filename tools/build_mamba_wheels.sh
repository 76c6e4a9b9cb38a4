#!/usr/bin/env bash
# Builds wheels of the field's Mamba kernels -- causal-conv1d (CUDA) and mamba-ssm (Triton-only by default) -- from
# their sdists on an OFFLINE GPU machine (no package index), for the torch already installed there, and optionally
# installs them into a --target folder. What transformers' GraniteMoeHybrid (Granite-4.0-H) needs from them:
#   causal_conv1d: causal_conv1d_fn, causal_conv1d_update, and the custom ops its C++/CUDA extension registers
#                  (mamba_ssm's fused Mamba-2 training kernel calls them for the depthwise conv);
#   mamba_ssm:     ops.triton.ssd_combined.{mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined} and
#                  ops.triton.selective_state_update.selective_state_update -- all Triton, no CUDA extension.
# mamba_ssm's own CUDA extension (selective_scan_cuda) is the Mamba-1 scan only. Its package __init__ imports it
# unconditionally, though (mamba_ssm/ops/selective_scan_interface.py: `import selective_scan_cuda`), and transformers
# imports the package root first: without the extension that import fails and transformers silently keeps its torch
# path. The Triton-only build therefore patches that one import into a try/except (Mamba-1 calls then fail loudly).
#
# Usage (repo-relative paths; the sdists come from a machine with an index, see docs/mamba_kernels.md):
#   bash build_mamba_wheels.sh SDIST_DIR WHEEL_DIR [TARGET_DIR]
# Environment:
#   PY=python3                 the python whose torch the extension is built against
#   MAX_JOBS=16                parallel compile jobs (ninja)
#   KERNEL_GENCODE="-gencode arch=compute_90,code=sm_90"
#                              the CUDA targets. Both setup.py files hard-code their own -gencode list (sm_75 ... sm_121
#                              with nvcc 13), and torch's cpp_extension then ignores TORCH_CUDA_ARCH_LIST, so the
#                              build patches the list to this one (H100/H200 = sm_90 only: a 9x shorter build).
#   MAMBA_CUDA=0               1: also build mamba_ssm's selective_scan_cuda extension (Mamba-1; not needed here)
#   BUILD_ONLY=                mamba_ssm or causal_conv1d: build (and install) that one alone
set -euo pipefail
SDIST=$(cd "${1:?sdist dir}" && pwd)
WHEELS=$(mkdir -p "${2:?wheel dir}" && cd "$2" && pwd)
TARGET=${3:-}
PY=${PY:-python3}
export MAX_JOBS=${MAX_JOBS:-16}
export KERNEL_GENCODE=${KERNEL_GENCODE:--gencode arch=compute_90,code=sm_90}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
MAMBA_CUDA=${MAMBA_CUDA:-0}
# never try the projects' prebuilt-wheel download (no network here: urlretrieve raises URLError, which their
# fallback does not catch), always compile
export CAUSAL_CONV1D_FORCE_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE
arch_tag=$(echo "$KERNEL_GENCODE" | grep -o 'sm_[0-9a-z]*' | tr -d _ | sort -u | paste -sd. -)
cuda_tag=cu$($PY -c 'import torch; print((torch.version.cuda or "cpu").replace(".", ""))')
export CAUSAL_CONV1D_LOCAL_VERSION=${CAUSAL_CONV1D_LOCAL_VERSION:-$cuda_tag.$arch_tag}
if [ "$MAMBA_CUDA" = 1 ]; then export MAMBA_SKIP_CUDA_BUILD=FALSE MAMBA_LOCAL_VERSION=${MAMBA_LOCAL_VERSION:-$cuda_tag.$arch_tag}
else export MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_LOCAL_VERSION=${MAMBA_LOCAL_VERSION:-triton}; fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xzf "$SDIST"/causal_conv1d-1.7.0.tar.gz -C "$work"
tar -xzf "$SDIST"/mamba_ssm-2.3.2.post1.tar.gz -C "$work"

# Patch the unpacked copies (each edit asserts its anchor, so a changed sdist fails here, not silently).
$PY - "$work" "$MAMBA_CUDA" <<'EOF'
import sys, pathlib
work, mamba_cuda = pathlib.Path(sys.argv[1]), sys.argv[2] == "1"

def edit(path, old, new):
    text = path.read_text()
    if text.count(old) != 1:
        sys.exit(f"patch anchor not found exactly once in {path}: {old!r}")
    path.write_text(text.replace(old, new))
    print(f"patched {path.relative_to(work)}")

HACK = "    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI is set to be the same as"
GENCODE = ('    if os.getenv("KERNEL_GENCODE") and not HIP_BUILD:  # patched: only the CUDA targets asked for\n'
           '        cc_flag = os.getenv("KERNEL_GENCODE").split()\n')
WHEEL_OLD = "from wheel.bdist_wheel import bdist_wheel as _bdist_wheel"
WHEEL_NEW = ("try:  # patched: newer `wheel` releases dropped bdist_wheel; setuptools has it\n"
             "    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel\n"
             "except ImportError:\n"
             "    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel")
for pkg in ("causal_conv1d-1.7.0", "mamba_ssm-2.3.2.post1"):
    setup = work / pkg / "setup.py"
    edit(setup, HACK, GENCODE + HACK)
    edit(setup, WHEEL_OLD, WHEEL_NEW)
if not mamba_cuda:
    edit(work / "mamba_ssm-2.3.2.post1/mamba_ssm/ops/selective_scan_interface.py", "\nimport selective_scan_cuda\n",
         "\ntry:  # patched: Triton-only build (Mamba-2 needs no CUDA extension of mamba_ssm)\n"
         "    import selective_scan_cuda\nexcept ImportError:\n    selective_scan_cuda = None\n")
EOF

PIPW="$PY -m pip wheel --no-build-isolation --no-deps --no-index -w $WHEELS"
BUILD_ONLY=${BUILD_ONLY:-}
built=()
for pkg in mamba_ssm causal_conv1d; do
  [ -z "$BUILD_ONLY" ] || [ "$BUILD_ONLY" = "$pkg" ] || continue
  t0=$(date +%s)
  if [ $pkg = causal_conv1d ]; then
    echo "== causal-conv1d 1.7.0 (CUDA: $KERNEL_GENCODE, MAX_JOBS=$MAX_JOBS)"
    $PIPW "$work/causal_conv1d-1.7.0"
  else
    echo "== mamba-ssm 2.3.2.post1 (its CUDA extension: $MAMBA_CUDA)"
    $PIPW "$work/mamba_ssm-2.3.2.post1"
  fi
  echo "built $pkg in $(( $(date +%s) - t0 )) s"
  built+=("$WHEELS/$pkg"-*.whl)
done
ls -l "${built[@]}"
if [ -n "$TARGET" ]; then
  # --no-deps: mamba-ssm's metadata asks for tilelang, apache-tvm-ffi and quack-kernels (Mamba-3 only) and
  # transformers/einops/triton/ninja, which the GPU image already has
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$TARGET" "${built[@]}"
  echo "installed into $TARGET (put it on PYTHONPATH)"
fi
