import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny test models run fastest on one thread: on a shared 2-core machine torch's threads
    spin against other processes (10x slower). Restored after each test, since CLI tests may
    pass --threads."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _cpu_cache(tmp_path_factory, monkeypatch):
    """Keep the measured-CPU cache out of the user's home."""
    import kvlab.hardware as hw

    monkeypatch.setattr(hw, "CACHE_FILE", tmp_path_factory.getbasetemp() / "kvlab-cpu.json")


def llama_like(**over) -> dict:
    """A Llama-style config dict for tests; keyword arguments override fields."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }
    cfg.update(over)
    return cfg
