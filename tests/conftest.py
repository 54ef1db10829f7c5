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
    """Keep the measured-CPU caches out of the user's home."""
    import kvlab.hardware as hw

    monkeypatch.setattr(hw, "CACHE_FILE", tmp_path_factory.getbasetemp() / "kvlab-cpu.json")
    monkeypatch.setattr(hw, "KERNEL_FILE", tmp_path_factory.getbasetemp() / "kvlab-kernels.json")


@pytest.fixture
def switch_off(monkeypatch):
    """``switch_off("KVLAB_KERNELS")``: that CPU path off from now on in this test, through its one
    switch, as a process started with ``KVLAB_KERNELS=off`` would see it (kvlab.dispatch reads the
    switches once per process: its decision is read afresh, and again after the test)."""
    from kvlab import dispatch

    def off(switch: str) -> None:
        monkeypatch.setenv(switch, "off")
        dispatch.backends.cache_clear()
        dispatch.onednn_bf16.cache_clear()

    yield off
    dispatch.backends.cache_clear()
    dispatch.onednn_bf16.cache_clear()


@pytest.fixture
def backends_with():
    """What runs here, with some paths forced on or off (``onednn_bf16=True``): kvlab.dispatch's
    decision as a model or a choice takes it as an argument, so a branch this CPU lacks is
    testable without patching the probe."""
    from dataclasses import replace

    from kvlab import dispatch

    def make(**on: bool) -> dispatch.Backends:
        here = dispatch.backends()
        return replace(here, **{name: dispatch.Feature(getattr(here, name).switch, value, "forced by a test")
                                for name, value in on.items()})

    return make


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
