#!/usr/bin/env bash
# Build the standalone one-folder bundle with PyInstaller, then smoke-test it.
#   bash packaging/build_bundle.sh [OUT_DIR]      (needs: pip install pyinstaller)
# The bundle carries numba where it is installed (pip install -e ".[fast]": PyInstaller follows
# core/secular_jit.py's import) and then compiles the stable update; without it, it solves on
# torch. The smoke test says which.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/bundle}"
# transformers imports each model family lazily: collect every family ctxpatch supports
# (the image+text families too, with their vision towers)
families=$(python -c "from ctxpatch.core.adapters import REGISTRY
from ctxpatch.core.images import IMAGE_TEXT_TYPES
types = set(REGISTRY) | set(IMAGE_TEXT_TYPES) | {'clip', 'siglip'}
print(' '.join(sorted({'--collect-submodules transformers.models.' + t.removesuffix('_text')
                      for t in types})))")
# shellcheck disable=SC2086
python -m PyInstaller --noconfirm --clean --onedir --name ctxpatch \
  --distpath "$out/dist" --workpath "$out/work" --specpath "$out" \
  --collect-data ctxpatch.resources --collect-submodules ctxpatch \
  $families --collect-submodules transformers.integrations \
  --collect-data transformers --copy-metadata transformers --copy-metadata torch \
  --copy-metadata tokenizers --copy-metadata safetensors --copy-metadata huggingface-hub \
  --copy-metadata ctxpatch --hidden-import pyqtgraph.exporters --collect-submodules gguf \
  ctxpatch/__main__.py
python packaging/smoke.py "$out/dist/ctxpatch/ctxpatch"
