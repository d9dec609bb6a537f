#!/usr/bin/env bash
# Download, here, the wheels benchmarks/gpu/run.sh installs on a GPU machine without internet access (one with
# Python 3.12, torch 2.11+cu130 and transformers 5.17): transformers 5.23, peft 0.21.2, gguf and regex, ~15 MB, into
# .whl/ at the repository root (git-ignored; copy it with the working tree). Then checks that the working tree plus
# .whl/ stay under 64 MiB, the most such a copy may hold.
#
#     bash benchmarks/gpu/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl transformers==5.23.0 peft==0.21.2 gguf==0.19.0 regex==2026.11.19
ls -l .whl

# What travels: tracked files and untracked files git does not ignore, plus the carried .whl/.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null \
    | awk '{s += $1} END {print s + 0}')
wheel_bytes=$(du -sb .whl | cut -f1)
total=$((tree_bytes + wheel_bytes))
limit=$((64 * 1024 * 1024))
awk -v t="$tree_bytes" -v w="$wheel_bytes" \
    'BEGIN {printf "working tree %.1f MiB + .whl %.1f MiB = %.1f MiB (limit 64 MiB)\n", t / 2^20, w / 2^20, (t + w) / 2^20}'
if [ "$total" -ge "$limit" ]; then
    echo "too large to copy in one piece: leave .whl/ smaller, or ignore large untracked files" >&2
    exit 1
fi
