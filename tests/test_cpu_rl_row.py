"""The CPU platform's row for Megatron-LM's train_rl.py step (patches/cpu_rl.py); no Megatron-LM needed."""
from mindspeed_proxy.patches import cpu_rl, cpu_transfer, registry


def test_default_packing_answers_none():
    """The wrapped get_default_packed_seq_params answers None (not packed) for any arguments, keeping its name."""
    def get_default_packed_seq_params(seq_length, max_sequences_per_bin, device):
        raise AssertionError("the original must not run")

    wrapped = cpu_rl._no_default_packing(get_default_packed_seq_params)
    assert wrapped(16, 50, "cpu") is None and wrapped(seq_length=4096, max_sequences_per_bin=1, device=0) is None
    assert wrapped.__name__ == "get_default_packed_seq_params"


def test_rows_are_cpu_platform_rows():
    """Registered under cpu-platform: the train_rl.py row optional (a checkout may be absent) and gated like the
    other Megatron-LM rows, the buffer row required and gated like megatron-core's."""
    cpu_transfer._register_all()
    packing = [p for p in registry._REGISTRY if p.target == cpu_rl.TARGET]
    assert len(packing) == 1 and packing[0].feature == cpu_transfer.FEATURE and packing[0].optional
    assert packing[0].versions == cpu_transfer.MEGATRON_LM_SUPPORTED
    buffer = [p for p in registry._REGISTRY if p.target == cpu_rl.BUFFER_TARGET]
    assert len(buffer) == 1 and buffer[0].feature == cpu_transfer.FEATURE and not buffer[0].optional
    assert buffer[0].versions == cpu_transfer.MEGATRON_CORE_SUPPORTED


def test_memory_buffer_made_in_inference_mode_is_not_reused_outside():
    """megatron-core's GlobalMemoryBuffer: a buffer made under inference_mode, asked for outside it, is an inference
    tensor that an in-place write refuses; through the row a fresh ordinary tensor comes back, and inside inference
    mode that ordinary buffer is reused as before."""
    import pytest
    import torch
    from megatron.core.utils import GlobalMemoryBuffer

    from mindspeed_proxy import platform

    original = GlobalMemoryBuffer.get_tensor
    with platform.activated("cpu"):  # the buffer allocates on torch.cuda.current_device()
        plain = GlobalMemoryBuffer()
        with torch.inference_mode():
            plain.get_tensor((4, 3), torch.float32, "mpu")
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
            original(plain, (4, 3), torch.float32, "mpu").copy_(torch.ones(4, 3))
        get_tensor = cpu_rl._no_inference_buffers(original)
        buffer = GlobalMemoryBuffer()
        with torch.inference_mode():
            made_inside = get_tensor(buffer, (4, 3), torch.float32, "mpu")
        assert made_inside.is_inference()
        outside = get_tensor(buffer, (4, 3), torch.float32, "mpu")
        assert not outside.is_inference()
        outside.copy_(torch.ones(4, 3))
        with torch.inference_mode():
            again = get_tensor(buffer, (2, 6), torch.float32, "mpu")
        assert again.data_ptr() == outside.data_ptr() and torch.equal(again, torch.ones(2, 6))
