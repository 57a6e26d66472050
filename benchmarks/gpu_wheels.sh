#!/usr/bin/env bash
# The wheels a GPU node needs carried for `python benchmarks/gpu_check.py`, downloaded on a connected
# machine for the node's Python and platform (default: CPython 3.12, manylinux x86_64, the lab's H100
# image, which has torch, transformers, accelerate, peft, typer, rich, pyyaml, safetensors, numpy,
# pyarrow and pytest, but not pydantic, datasets, openai or httpx2).
#
#   bash benchmarks/gpu_wheels.sh [DIR] [PYTHON_VERSION]        # default: .whl 3.12
#   # then on the node, from the repository root:
#   python3 -m pip install --no-index --find-links DIR dllm-align && python benchmarks/gpu_check.py --out gpu-check
#
# pip resolves against what the node already has, so only the missing packages are installed.
# An image whose transformers is older than 5.2 (dllm-align refuses those: they make every diffusion body
# causal) needs it carried too: EXTRA="transformers>=5.2,<6 tokenizers huggingface_hub" bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${2:-3.12}
ABI=cp${PY/./}
mkdir -p "$DIR"
python3 -m pip wheel -q --no-deps . -w "$DIR"
python3 -m pip download -q --only-binary=:all: --python-version "$PY" --implementation cp --abi "$ABI" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$DIR" "pydantic>=2.5,<3" "datasets>=3.0" "openai>=3.20,<4" "httpx2>=2.12,<3" ${EXTRA:-}
echo "wheels for $ABI manylinux x86_64 in $DIR: $(ls "$DIR" | wc -l) files, $(du -sh "$DIR" | cut -f1)"
