#!/usr/bin/env bash
# The wheels bench/gpu_check.sh installs on a machine that reaches no index:  bash bench/gpu_wheels.sh DIR [PYVER]
#   DIR    where they go (.whl for the lent GPU machine, git-ignored; the dry run uses .whl-dry)
#   PYVER  the target Python: 3.12 (the lent machine's image, manylinux x86_64) by default, or "here" for this
#          machine's own Python and platform (the dry run).
# What the lent image lacks (device tool's KINDS.md: torch 2.11, transformers 5.17, grpcio, protobuf, accelerate,
# safetensors, prometheus-client, pytest, psutil, hypothesis, h11, anyio are there): logitserve itself, built
# here with its generated stubs; grpcio-health-checking and grpcio-reflection at 1.71.0, whose generated code
# loads on protobuf 5.29+ and any grpcio >= 1.71; starlette, uvicorn, orjson for --http-port; transformers at
# 5.20.2 (the floor in pyproject, tested here; the image's 5.17 predates it) with the tokenizers and regex it
# needs (its huggingface-hub floor, 1.31, the image meets). Afterwards the
# set is installed into a clean --target directory with pip's platform options, as the lent machine will.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: bench/gpu_wheels.sh DIR [3.12|here]}
PYVER=${2:-3.12}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
PINS=(grpcio-health-checking==1.71.0 grpcio-reflection==1.71.0 starlette==1.10.0 uvicorn==0.55.0 orjson==3.13.0
      transformers==5.20.2 tokenizers==0.23.3 regex==2026.11.19)
if [ "$PYVER" = here ]; then
  PLATFORM=()
else
  PLATFORM=(--only-binary=:all: --python-version "$PYVER" --implementation cp)
  for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
             manylinux1_x86_64; do PLATFORM+=(--platform "$tag"); done
fi
"$PY" -m pip wheel -q --no-deps -w "$DIR" .
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DIR" "${PINS[@]}"
# one version of each: two stop the whole install there
dupes=$(ls "$DIR" | sed -E 's/-[0-9].*//' | sort | uniq -d)
[ -z "$dupes" ] || { echo "two versions of: $dupes" >&2; exit 1; }
check=$(mktemp -d)
"$PY" -m pip install -q --no-index --no-deps --target "$check" "${PLATFORM[@]}" "$DIR"/*.whl
rm -rf "$check"
echo "$(ls "$DIR" | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1)), installable for ${PYVER}: $(ls "$DIR" | tr '\n' ' ')"
