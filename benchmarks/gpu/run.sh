#!/usr/bin/env bash
# Every GPU check in two runs: the CUDA tests (exactness first), the attention benchmark (64K-1M tokens, top-1 and
# top-2, dense in the same run), decoding against a 256K and a 1M cache (eager; then eager and compiled), model-level
# bf16 prefill with SmolLM2-135M's architecture (random weights, the committed adapter's settings) at 128K, `auto`
# from 1K to 64K, peak memory at 64K and 1M, a profile at 4K and 64K (wall against device time), a short
# `focus-hf train` distillation on CUDA, and last the layer at 64K with the GPU path in pieces and in one piece
# (FOCUS_HF_GPU_ONE_PIECE_ROWS). Stages, files and figures: benchmarks/gpu/run.py's docstring and README.md.
#
# ON A GPU MACHINE WITHOUT INTERNET ACCESS, within 15 minutes of GPU time in all (start-up included) and at most 10
# minutes per command: two runs, --quick (within 420 s), then the full set (within 330 s).
#   1. here, once (downloads ~15 MB of wheels into the git-ignored .whl/: transformers 5.23, peft 0.21.2, gguf,
#      regex for the machine's Python 3.12; the machine has no internet and older packages):
#          bash benchmarks/gpu/fetch_wheels.sh
#   2. copy the working tree and .whl/ to the machine and run, from the repository root, with a limit of 480 s:
#          FOCUS_HF_GIT_COMMIT=<git rev-parse HEAD here> bash benchmarks/gpu/run.sh --quick
#      (a copy of the working tree has no .git: the variable records the commit measured): the CUDA tests, prefill at
#      64K-1M, eager decoding and the model at 128K within 420 s. Then at once (the machine still warm), with a limit
#      of 390 s, the full set: `... bash benchmarks/gpu/run.sh`. The results are written to $OUT/gpu/ where $OUT is
#      set (4 and 6 stage files, each with summary.json).
#
# HERE, TO CHECK THE SCRIPT (no GPU; small sizes, float32, every stage; tests/benchmarking/test_gpu_script.py runs
# this):
#          bash benchmarks/gpu/run.sh --device cpu --out /tmp/gpu-check
#
# Options (all but --bootstrap / --no-bootstrap go to run.py): --device cuda|cpu, --quick, --out DIR (default $OUT/gpu when
# $OUT is set, else benchmarks/results/gpu), --only STAGE..., --skip STAGE..., --deadline SECONDS,
# --timeout STAGE=SECONDS. The wheels in .whl/ are installed into a temporary folder first when the device is cuda
# and .whl/ holds wheels; --bootstrap / --no-bootstrap force either way.
# Exit code: 0 when every stage ran and exited 0 (the figures' targets are in the summary, not in the exit code).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

bootstrap=auto
device=cuda
args=()
previous=
for arg in "$@"; do
    case "$arg" in
        --bootstrap) bootstrap=yes ;;
        --no-bootstrap) bootstrap=no ;;
        --device=*) device="${arg#--device=}"; args+=("$arg") ;;
        *) [ "$previous" = --device ] && device="$arg"; args+=("$arg") ;;
    esac
    previous="$arg"
done

python=${PYTHON:-python3}
if [ "$bootstrap" = yes ] || { [ "$bootstrap" = auto ] && [ "$device" = cuda ] && compgen -G ".whl/*.whl" >/dev/null; }; then
    site=$(mktemp -d)
    echo "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into $site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "benchmarks/gpu/run.sh: installing the wheels of .whl/ failed" >&2; exit 1; }
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$python" -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
exec "$python" benchmarks/gpu/run.py "${args[@]}"
