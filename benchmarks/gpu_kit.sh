#!/usr/bin/env bash
# `make bench` on a lent GPU machine (the `device` tool), in one short prepared run.
#
# That machine has Python 3.12 with a CUDA build of PyTorch, transformers and grpcio, but it
# can fetch nothing, and it has no redis-server; its package versions are not ours. So:
#
#   bash benchmarks/gpu_kit.sh prepare
#       here, where PyPI is reachable: fills .gpukit/ (ignored by git through
#       .git/info/exclude) with Python 3.12 wheels of our pinned packages and this machine's
#       redis-server with the libraries a base image lacks (about 27 MB);
#   device run, carry [".gpukit"], command "bash benchmarks/gpu_kit.sh run", timeout 540:
#       installs the wheels into /tmp/site, checks CUDA, runs benchmarks.cuda_check (the
#       paths only a GPU takes, against references: about a minute; cuda-check.log), times
#       the target's forwards with SDPA per session against the paged caches' batched
#       attention, by turns (attention-gpu.log), then the benchmark with a bf16 target and
#       draft on the GPU, and leaves RESULTS-gpu.md,
#       speedup-gpu.png and the logs under $OUT. Copy them into benchmarks/ and add the
#       table to README.md.
#
# `run` also takes extra arguments for benchmarks.bench (e.g. --repeats 1 to fit the lease).
set -euo pipefail
KIT=.gpukit
# ours, pinned as in requirements.txt; torch stays the machine's CUDA build
# (safetensors 0.8.0, huggingface-hub and tqdm are there already; transformers checks
# regex's version at import)
WHEELS=(transformers==5.24.0 tokenizers==0.23.3 grpcio==1.85.3 grpcio-health-checking==1.85.1
        grpcio-reflection==1.85.1 protobuf==7.36.2 redis==8.1.0 prometheus-client==0.26.0
        regex==2026.11.19 uvloop==0.23.0)
# libraries redis-server links that a base Ubuntu image lacks (it has libssl, libsystemd and
# theirs): the working tree and the kit together must stay under the tool's 64 MiB
REDIS_LIBS='libjemalloc|liblzf|libatomic'
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux1_x86_64)

prepare() {
    cd "$(git rev-parse --show-toplevel)"
    grep -qx '/.gpukit/' .git/info/exclude 2>/dev/null || echo '/.gpukit/' >> .git/info/exclude
    rm -rf "$KIT" && mkdir -p "$KIT/whl" "$KIT/bin" "$KIT/lib"
    local py=${PYTHON:-.venv/bin/python}
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $(printf -- '--platform %s ' "${PLATFORMS[@]}") -d "$KIT/whl" "${WHEELS[@]}"
    local server
    server=$(command -v redis-server) || { echo "no redis-server here: make redis first" >&2; exit 1; }
    cp "$server" "$KIT/bin/redis-server"
    ldd "$server" | awk '$3 ~ /^\// {print $3}' | grep -E "/($REDIS_LIBS)\.so" | xargs -r -I{} cp -L {} "$KIT/lib/"
    du -sh "$KIT"
}

run() {
    : "${OUT:?run on the device machine, where \$OUT is set}"
    [ -d "$KIT/whl" ] || { echo "no $KIT: run 'bash benchmarks/gpu_kit.sh prepare' here and carry it" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$KIT"/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    cat > /tmp/redis-server <<EOF
#!/bin/sh
LD_LIBRARY_PATH=$PWD/$KIT/lib exec $PWD/$KIT/bin/redis-server "\$@"
EOF
    chmod +x /tmp/redis-server "$KIT/bin/redis-server"
    if LD_LIBRARY_PATH=$PWD/$KIT/lib ldd "$KIT/bin/redis-server" | grep 'not found'; then
        echo "redis-server lacks the libraries above there: add them to REDIS_LIBS and prepare again" >&2; exit 1
    fi
    export SPECDEC_REDIS_SERVER=/tmp/redis-server
    /tmp/redis-server --version
    python3 -c "import torch, transformers, grpc; assert torch.cuda.is_available(), 'no CUDA'; \
print(torch.__version__, torch.cuda.get_device_name(), 'transformers', transformers.__version__, 'grpc', grpc.__version__)"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
    set -o pipefail
    python3 -m benchmarks.cuda_check 2>&1 | tee "$OUT/cuda-check.log" ||
        echo "cuda_check: some checks failed (cuda-check.log); the benchmark runs all the same"
    python3 -m benchmarks.dtype_probe --device cuda --dtypes bfloat16 --attention sdpa,paged \
        --shapes 1x1,1x5,4x5,16x5,64x5 --count-ops 2>&1 | tee "$OUT/attention-gpu.log" || true
    python3 -m benchmarks.bench --device cuda --dtype bfloat16 --draft-dtype bfloat16 \
        --out "$OUT/RESULTS-gpu.md" --plot "$OUT/speedup-gpu.png" "$@" 2>&1 | tee "$OUT/bench-gpu.log"
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
