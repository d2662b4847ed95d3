#!/usr/bin/env bash
# `make .venv-swift` / `make .venv-llamafactory`: one virtual environment per training framework,
# with the versions that framework installs, and dflop-ds editable on top of them.
#
# Each framework pins its own transformers / TRL / DeepSpeed, and its multimodal processors need
# torchvision (Qwen2-VL's video processor) and torchaudio (LLaMA-Factory's mm_plugin imports it at
# load). The registry's torchvision/torchaudio do not load against the CPU torch 2.13 build, so
# both environments use a set that loads together: torch 2.11.0, torchvision 0.26.0, torchaudio
# 2.11.0 (CUDA builds, about 4.7 GB; with no GPU they run on the CPU). Everything is asked for in
# ONE pip command so the resolver cannot move torch, then dflop-ds is installed editable under a
# constraints file frozen from that environment: its own torch / transformers ranges never
# override the framework's.
#
# Usage: benchmarks/framework_envs.sh swift|llamafactory DEST   (PYTHON: the interpreter, python3)
set -euo pipefail

FRAMEWORK=$1
DEST=$2
PYTHON=${PYTHON:-python3}
TORCH_SET=(torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0)

case $FRAMEWORK in
  swift) PINS=(ms-swift==4.6.0 "transformers>=5.19,<5.20" "trl>=0.29,<0.30" deepspeed==0.19.8 qwen-vl-utils) ;;
  llamafactory) PINS=(llamafactory==0.9.5 transformers==5.6.0 trl==0.24.0 deepspeed==0.18.4) ;;
  *) echo "framework_envs.sh: unknown framework '$FRAMEWORK' (swift or llamafactory)" >&2; exit 2 ;;
esac

rm -rf "$DEST"
"$PYTHON" -m venv "$DEST"
PIP=("$DEST/bin/python" -m pip)
"${PIP[@]}" install --quiet --upgrade pip
"${PIP[@]}" install --quiet "${TORCH_SET[@]}" "${PINS[@]}"
"${PIP[@]}" freeze --exclude-editable >"$DEST/framework-frozen.txt"
# dflop-ds and its test tools; every package the framework brought stays at its version
"${PIP[@]}" install --quiet -c "$DEST/framework-frozen.txt" -e ".[hf,test]"
# the environment must import the framework, its multimodal processors and dflop-ds together
"$DEST/bin/python" - "$FRAMEWORK" <<'EOF'
import importlib
import sys

import torch, torchaudio, torchvision, transformers, trl, deepspeed  # noqa: E401
import dflop_ds

importlib.import_module({"swift": "swift", "llamafactory": "llamafactory"}[sys.argv[1]])
print(f"{sys.argv[1]}: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"trl {trl.__version__}, deepspeed {deepspeed.__version__}")
EOF
# DeepSpeed JIT-builds its CPU communication op once, in the environment's own folder
PATH="$(cd "$DEST" && pwd)/bin:$PATH" TORCH_EXTENSIONS_DIR="$(cd "$DEST" && pwd)/torch_extensions" \
  "$DEST/bin/python" -c "from dflop_ds.host import build_deepspeed_ops; print(build_deepspeed_ops())"
touch "$DEST/.installed"
