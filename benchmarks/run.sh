#!/usr/bin/env bash
# The runs behind docs/benchmarks.md. One at a time: they share 2 cores. Results go to out/bench/.
# VLLM_PY=/path/to/vllm-venv/bin/python adds the vLLM peer runs.
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kvlab
M="qwen2.5-0.5b --random-weights --dtype bf16 --threads ${THREADS:-2}"
mkdir -p out/bench
run() { local name=$1; shift; echo "== $name: kvlab $*"; "$K" "$@" --json > "out/bench/$name.json"; }

# issue 5 targets
run throughput   bench $M --num-requests 64 --input-len 64:512 --output-len 32:256 --compare hf
run batch1       bench $M --num-requests 1 --input-len 128 --output-len 128 --compare hf
run prefix       bench $M --num-requests 32 --input-len 512 --output-len 16 --shared-prefix 448
run noshare-on   bench $M --num-requests 32 --input-len 64:512 --output-len 32:64
run noshare-off  bench $M --num-requests 32 --input-len 64:512 --output-len 32:64 --no-prefix-caching
run fp8          bench $M --num-requests 64 --input-len 64:512 --output-len 32:256 --kv-dtype fp8_e4m3
# the peer, vLLM's CPU build, on the same seeded workloads (its own venv: docs/benchmarks.md)
if [ -n "${VLLM_PY:-}" ]; then
  peer() { local name=$1; shift; echo "== $name: vllm_peer.py $*"
    VLLM_CPU_OMP_THREADS_BIND=0-$(( ${THREADS:-2} - 1 )) PYTHONPATH=. "$VLLM_PY" benchmarks/vllm_peer.py \
      qwen2.5-0.5b "$@" 2>/dev/null | grep "^{" > "out/bench/$name.json"; }
  peer vllm-throughput --num-requests 64 --input-len 64:512 --output-len 32:256
  peer vllm-batch1     --num-requests 1 --input-len 128 --output-len 128
fi
# the planner and the measurement on the bundled model
/usr/bin/time -f "plan: %e s" "$K" plan llama-3.1-70b --context 131072 --users 4 --gpus 8 > /dev/null
"$K" measure --json --plot out/bench/measure.png > out/bench/measure.json
