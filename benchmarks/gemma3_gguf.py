"""Write a GGUF file llama.cpp loads as a Gemma-3 model, from a config.json, with random weights and
SmolLM2-135M's tokenizer: the sliding-window model of benchmarks/engine_lines.py.

    .venv/bin/python benchmarks/gemma3_gguf.py tests/fixtures/engine_lines/gemma3-8l/config.json OUT.gguf

Only what llama.cpp's gemma3 loader reads is written: the architecture's hyperparameters, the
tokenizer (copied field by field from the bundled SmolLM2 GGUF, whose vocabulary the config's
vocab_size must equal) and f16 tensors of the right shapes. The weights are random: the file exists
to make llama-server allocate and report its KV caches, not to generate text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

ARCH = "gemma3"


def copy_tokenizer(writer: GGUFWriter, source: Path) -> int:
    """Copy every tokenizer.* field of `source` into `writer`; returns the vocabulary size."""
    reader = GGUFReader(source)
    vocab = 0
    for name, f in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = f.types[0]
        if kind == GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == GGUFValueType.STRING:
                values = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                values = [f.parts[i][0].item() for i in f.data]
            writer.add_array(name, values)
            if name == "tokenizer.ggml.tokens":
                vocab = len(values)
        elif kind == GGUFValueType.STRING:
            writer.add_string(name, bytes(f.parts[f.data[0]]).decode("utf-8"))
        else:
            writer.add_key_value(name, f.parts[f.data[0]][0].item(), kind)
    return vocab


def main(config_path: str, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kvlab.catalog import model_path

    cfg = json.loads(Path(config_path).read_text())
    hidden, heads, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    layers, ff, vocab = cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    w = GGUFWriter(out, ARCH)
    w.add_name("kvlab gemma3-8l (random weights)")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_file_type(1)  # mostly f16
    if copy_tokenizer(w, model_path("smollm2-135m")) != vocab:
        raise SystemExit(f"vocab_size {vocab} differs from SmolLM2's tokenizer")
    rng = np.random.default_rng(0)

    def t(name: str, *shape: int) -> None:
        # numpy order is (rows, cols) = GGUF's (ne1, ne0)
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float16))

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    t("token_embd.weight", vocab, hidden)
    norm("output_norm.weight", hidden)
    for i in range(layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", hidden)
        t(b + "attn_q.weight", heads * hd, hidden)
        t(b + "attn_k.weight", kv * hd, hidden)
        t(b + "attn_v.weight", kv * hd, hidden)
        t(b + "attn_output.weight", hidden, heads * hd)
        norm(b + "post_attention_norm.weight", hidden)
        norm(b + "attn_k_norm.weight", hd)
        norm(b + "attn_q_norm.weight", hd)
        norm(b + "ffn_norm.weight", hidden)
        t(b + "ffn_gate.weight", ff, hidden)
        t(b + "ffn_up.weight", ff, hidden)
        t(b + "ffn_down.weight", hidden, ff)
        norm(b + "post_ffw_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
