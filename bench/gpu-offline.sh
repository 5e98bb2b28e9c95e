#!/usr/bin/env bash
# The GPU kit on a GPU machine without network access, in one call (docs/results/bench-gpu.md, "How to run it").
#
# On a machine with network access first: `python -m vitserve.bench.gpu_wheels --out .whl` (onnxruntime-gpu slimmed to
# sm_90's code, the H100's and the H200's, the web stack's wheels) and Debian's wrk with its libluajit in .whl/bin and
# .whl/lib (`make gpu-wheels`). The GPU machine's own python3 (3.12, with torch for the exports, CUDA 13 and cuDNN 9 as NVIDIA's pip packages) runs
# everything: the wheels go into a --target folder ahead of its site-packages, so its onnxruntime (CPU) is shadowed
# by onnxruntime-gpu.
#
#   bash bench/gpu-offline.sh OUT_DIR [kit flags...]
set -uo pipefail
out=${1:?usage: bench/gpu-offline.sh OUT_DIR [kit flags]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
site=/tmp/vitserve-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    >"$out/pip.log" 2>&1 || { tail -20 "$out/pip.log"; exit 1; }
export PYTHONPATH="$site:$PWD"
# onnxruntime-gpu finds CUDA and cuDNN through the loader's path: NVIDIA's pip packages keep them in nvidia/*/lib
cuda_libs=$(python3 -c 'import glob, nvidia; print(":".join(d for p in nvidia.__path__ for d in glob.glob(p + "/**/lib", recursive=True)))')
export LD_LIBRARY_PATH="$PWD/.whl/lib:$cuda_libs:${LD_LIBRARY_PATH:-}"
export PATH="$PWD/.whl/bin:$PATH"
nvidia-smi -L
python3 -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.get_available_providers())'
python3 -m vitserve.bench.gpu --no-install --out "$out/bench-gpu.md" "$@"
code=$?
tar czf "$out/logs.tgz" build/gpu/*.log build/gpu/logs 2>/dev/null
exit $code
