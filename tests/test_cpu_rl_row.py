"""The CPU platform's row for Megatron-LM's train_rl.py step (patches/cpu_rl.py); no Megatron-LM needed."""
from mindspeed_proxy.patches import cpu_rl, cpu_transfer, registry


def test_default_packing_answers_none():
    """The wrapped get_default_packed_seq_params answers None (not packed) for any arguments, keeping its name."""
    def get_default_packed_seq_params(seq_length, max_sequences_per_bin, device):
        raise AssertionError("the original must not run")

    wrapped = cpu_rl._no_default_packing(get_default_packed_seq_params)
    assert wrapped(16, 50, "cpu") is None and wrapped(seq_length=4096, max_sequences_per_bin=1, device=0) is None
    assert wrapped.__name__ == "get_default_packed_seq_params"


def test_row_is_an_optional_cpu_platform_row():
    """Registered under cpu-platform, optional (a checkout may be absent), gated like the other Megatron-LM rows."""
    cpu_transfer._register_all()
    rows = [p for p in registry._REGISTRY if p.target == cpu_rl.TARGET]
    assert len(rows) == 1 and rows[0].feature == cpu_transfer.FEATURE and rows[0].optional
    assert rows[0].versions == cpu_transfer.MEGATRON_LM_SUPPORTED
