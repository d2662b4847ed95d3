#!/usr/bin/env bash
# `make gpu-wheels`: the wheels a bare GPU machine lacks for `make gpu-check`, in .gpu-wheels/.
#
# The lent GPU machines have Python 3.12 with a CUDA torch, transformers, tokenizers,
# huggingface_hub, accelerate, peft, pillow, numpy, scikit-learn, tqdm, psutil, py-cpuinfo,
# msgpack, ninja, einops, nvidia-ml-py and packaging, and no network. This puts next to the
# repository what is missing there: DeepSpeed (its PyPI release is an sdist only: built here as a
# pure-Python wheel, DS_BUILD_OPS=0, its ops JIT-built where needed), DeepSpeed's dependencies
# that are not there (hjson, pydantic with pydantic-core for CPython 3.12, annotated-types,
# typing-inspection, a typing-extensions new enough for pydantic), PuLP, dflop-ds itself, and
# transformers at the version tested here (the machines' 5.17 needs torchvision to load a
# Qwen2-VL image processor). PyAV (36 MB) only with GPU_WHEELS_VIDEO=1: the check reads no video.
# benchmarks/gpu_check.py installs them with `pip install --no-index --no-deps --target`.
#
# Usage: benchmarks/gpu_wheels.sh [DEST]   (PY: the interpreter whose pip and torch build DeepSpeed)
set -euo pipefail

PY=${PY:-python3}
DEST=${1:-.gpu-wheels}
PLATFORM=(--python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
BINARY=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 pulp==3.3.2 transformers==5.24.0)
if [[ ${GPU_WHEELS_VIDEO:-0} == 1 ]]; then BINARY+=(av==18.1.0); fi

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$DEST" "${BINARY[@]}"
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$DEST" deepspeed==0.19.8
"$PY" -m pip wheel --quiet --no-deps -w "$DEST" .

# every wheel installs offline; the pure-Python ones import here (the cp312 ones need Python 3.12)
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --only-binary=:all: "${PLATFORM[@]}" \
  --target "$check" "$DEST"/*.whl
PYTHONPATH="$check" "$PY" -c "import annotated_types, hjson, pulp, typing_inspection; print('pure-Python wheels import')"
for wheel in "$DEST"/*.whl; do
  case $wheel in *-none-any.whl | *cp312-cp312-manylinux* | *abi3-manylinux*) ;;
    *) echo "not for CPython 3.12 on x86_64 Linux: $wheel" >&2; exit 1 ;;
  esac
done
ls -1 "$DEST"
echo "gpu-wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sm "$DEST" | cut -f1) MiB in $DEST"
