#!/usr/bin/env bash
# The CPU-sensitive tests once per switch setting this machine supports (kvlab/dispatch.py):
# each CPU-dependent path this CPU has is turned off in turn, then all of them, so the branch a
# CPU without it takes is tested here too. `make test` runs it after the suite (CI too).
#   scripts/test_dispatch.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

# the tests whose paths or answers depend on the CPU's features
TESTS=(tests/test_kernels.py tests/test_deterministic.py tests/test_memory.py tests/test_models.py
       tests/test_engine_parity.py tests/test_logprobs.py tests/test_weights.py
       tests/test_engine_attention.py tests/test_kernel_binding.py tests/test_act8.py
       "tests/test_gguf.py::test_smollm2_answers_paris_from_the_cli"
       "tests/test_cli_text.py::test_measure_explains_bf16_differences_and_fp32_agrees"
       "tests/test_tiers.py::test_blocks_that_leave_the_pool_come_back_from_ram_bitwise"
       "tests/test_tiers.py::test_a_restart_reads_the_prompts_back_from_disk_with_the_same_tokens")

# the switches whose path runs here: turning off one that is already off tests nothing new
mapfile -t ON < <("$PY" -c 'from kvlab import dispatch
for f in dispatch.report():
    if f.on: print(f.switch)')
if [ ${#ON[@]} -eq 0 ]; then
    echo "test_dispatch: no CPU-dependent path runs here; the suite already ran the only branch"
    exit 0
fi
SETTINGS=()
for switch in "${ON[@]}"; do SETTINGS+=("$switch=off"); done
if [ ${#ON[@]} -gt 1 ]; then SETTINGS+=("$(printf '%s=off ' "${ON[@]}")"); fi
# on an AVX-512 CPU, PyTorch's and oneDNN's own switches take an AVX2-only CPU's branches too
# (kvlab's oneDNN probe then fails as it does there)
if [ "$("$PY" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" = AVX512 ]; then
    SETTINGS+=("ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2")
fi

for setting in "${SETTINGS[@]}"; do
    read -r -a env_args <<< "$setting"
    echo "== test_dispatch: ${env_args[*]}"
    env "${env_args[@]}" "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
done
