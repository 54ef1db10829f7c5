"""Peer engines' own start-up lines, predicted: vllm.py (V1's KV cache size and maximum
concurrency) and llamacpp.py (llama-server's `llama_kv_cache: size = ...`)."""
