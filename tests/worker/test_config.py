"""Worker settings that depend on the device: the batch limits left at 0 take the device's defaults."""

from worker.config import DEVICE_DEFAULTS, WorkerConfig


def test_batch_limits_left_at_zero_take_the_devices_defaults():
    cpu = WorkerConfig().for_device("cpu")
    gpu = WorkerConfig().for_device("cuda")
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.max_prefill_chunk) == (128, 512, 64)
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.max_prefill_chunk) == (256, 8192, 2048)
    assert set(DEVICE_DEFAULTS["cpu"]) == set(DEVICE_DEFAULTS["cuda"])


def test_limits_given_explicitly_are_kept_on_every_device():
    config = WorkerConfig(max_num_seqs=7, max_num_batched_tokens=96, max_prefill_chunk=16)
    for device in ("cpu", "cuda"):
        resolved = config.for_device(device)
        assert (resolved.max_num_seqs, resolved.max_num_batched_tokens, resolved.max_prefill_chunk) == (7, 96, 16)
