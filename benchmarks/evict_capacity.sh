#!/usr/bin/env bash
# Memory turned into concurrency: the same fixed --kv-memory (two whole sequences of 4,096 + 256
# tokens of the default model, fp32 KV) under each policy at a 25% budget; kvlab bench's "sequences at once"
# and output tokens/s are the figures of docs/benchmarks.md. Run alone: it times the engine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=out/bench
mkdir -p "$OUT"
KV=".venv/bin/kvlab"
WORK=(--num-requests 8 --input-len 4096 --output-len 256 --max-model-len 4352 --kv-memory 383MiB)
$KV bench "${WORK[@]}" --json > "$OUT/capacity-full.json"
for policy in streaming snapkv adakv; do
    $KV bench "${WORK[@]}" --kv-policy "$policy" --kv-budget 1024 --json > "$OUT/capacity-$policy.json"
done
