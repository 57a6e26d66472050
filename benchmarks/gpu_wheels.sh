#!/usr/bin/env bash
# Wheels a GPU node needs for `python benchmarks/gpu_check.py`, and installing only the missing ones there.
#
#   bash benchmarks/gpu_wheels.sh [DIR] [PYTHON_VERSION]   # on a connected machine: download (default: .whl 3.12)
#   bash benchmarks/gpu_wheels.sh install DIR              # on the node: install what the image lacks
#
# Download: what the lab's H100 image lacks for the training path and the tests (pydantic and its needs; the
# image has torch, transformers, accelerate, peft, typer, rich, pyyaml, safetensors, numpy, pyarrow, pytest),
# for CPython 3.12 manylinux x86_64, with their needs (the install step skips those the image has). EXTRA adds more, e.g. an image
# whose transformers is older than 5.2 (dllm-align refuses those: they make every diffusion body causal):
#   EXTRA="transformers>=5.2,<6 tokenizers huggingface_hub" bash benchmarks/gpu_wheels.sh
#
# Install: a wheel whose distribution the image already has (any version) is left out; the rest go to
# $SITE (default /tmp/dllm-align-site) with --no-deps, and that folder is APPENDED to the image's
# sys.path through a .pth file in the image's own site-packages, so the image's packages always come
# first (never PYTHONPATH, which would put the carried ones ahead of them).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "install" ]; then
  DIR=${2:?usage: gpu_wheels.sh install DIR}
  SITE=${SITE:-/tmp/dllm-align-site}
  PY=${PYTHON:-python3}
  missing=()
  for w in "$DIR"/*.whl; do
    [ -e "$w" ] || continue
    name=$(basename "$w" | cut -d- -f1)
    if "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null; then
      echo "have $name ($("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")): not installing $(basename "$w")"
    else
      missing+=("$w")
    fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${missing[@]}"
    pth=$("$PY" -c "import site; print(site.getsitepackages()[0])")/zz-dllm-align-carried.pth
    echo "$SITE" > "$pth"
    echo "installed ${#missing[@]} wheels into $SITE, after the image's site-packages ($pth)"
  else
    echo "nothing to install: the image has every carried package"
  fi
  exit 0
fi
DIR=${1:-.whl}
PY=${2:-3.12}
ABI=cp${PY/./}
mkdir -p "$DIR"
python3 -m pip download -q --only-binary=:all: --python-version "$PY" --implementation cp --abi "$ABI" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$DIR" "pydantic>=2.5,<3" ${EXTRA:-}
echo "wheels for $ABI manylinux x86_64 in $DIR: $(ls "$DIR" | wc -l) files, $(du -sh "$DIR" | cut -f1)"
