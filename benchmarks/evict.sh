#!/usr/bin/env bash
# kvlab evict on the default model (SmolLM2-135M-Instruct): the figures in docs/benchmarks.md.
# Quality figures are deterministic (fp32, greedy, batch-invariant engine); the time column depends
# on the machine's load. One thread per run: two runs share the 2 cores without spinning threads.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=out/bench
mkdir -p "$OUT"
KV=".venv/bin/kvlab"
$KV evict --task needle --context 2048 --budgets 256,512 --trials 20 --threads 1 \
    --json --plot "$OUT/evict-needle.png" > "$OUT/evict-needle.json" &
$KV evict --task perplexity --context 2048 --budgets 128,256,512 --threads 1 \
    --json --plot "$OUT/evict-perplexity.png" > "$OUT/evict-perplexity.json"
wait
$KV evict --task perplexity --context 1024 --policies full,streaming --budgets 256 \
    --kv-dtype auto,bf16,fp8_e4m3,fp8_e5m2,int8 --threads 1 \
    --json --plot "$OUT/evict-dtypes.png" > "$OUT/evict-dtypes.json"
$KV evict --task ruler --context 2048 --budgets 256,512 --trials 10 --policies full,streaming,snapkv,adakv \
    --threads 1 --json --plot "$OUT/evict-ruler.png" > "$OUT/evict-ruler.json"
# issue 38's real models (kvlab models --install gemma3-270m, qwen2.5-coder-1.5b): 25% of 4,096 tokens;
# Gemma 3 evicts on its 3 global layers only, its 15 sliding layers keep their 512-token window
$KV evict gemma3-270m --task ruler --context 4096 --budgets 1024 --trials 5 --policies full,streaming,snapkv,adakv \
    --json --plot "$OUT/evict-gemma-ruler.png" > "$OUT/evict-gemma-ruler.json"
$KV evict qwen2.5-coder-1.5b --task ruler --context 4096 --budgets 1024 --trials 4 --policies full,snapkv,adakv \
    --json --plot "$OUT/evict-qwen-ruler.png" > "$OUT/evict-qwen-ruler.json"
# kvlab's policies, kvpress's presses and OpenVINO GenAI's eviction modes on the same prompts
# (bash benchmarks/peers.sh kvpress; bash benchmarks/peers.sh openvino)
.venv/bin/python benchmarks/evict_peers.py --task needle --context 2048 --budgets 256,512 --trials 20 \
    --presses none,snapkv,adakv,tova,expected_attention,observed_attention --threads 1
