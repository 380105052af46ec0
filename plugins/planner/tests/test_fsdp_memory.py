"""FSDP's per-device memory shrinks as devices are added: each layer gathers its own weights
(``redco.fsdp``), so XLA never all-gathers activations over the global batch instead, which
made the peak rise with the device count (measured on this model before the gather: peak 138,
then 159 MB from 4 to 8 devices without remat; 120, then 150 MB with ``dots_saveable``)."""
import pytest

from redco_planner.inspection import zoo_llama
from redco_planner.measure import measure


@pytest.fixture(scope="module")
def llama():
    """The zoo LLaMA, width 512, 4 layers, one 256-token row per device: weights big enough
    next to the activations that the partitioner's choice shows."""
    return zoo_llama(256, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=8)


@pytest.mark.parametrize("remat", ["none", "dots_saveable"])
def test_an_fsdp_steps_peak_per_device_does_not_rise_with_devices(llama, remat):
    peaks = {n: measure(llama.params, llama.loss_fn, llama.batch(1), n, 1,
                        sharding_rules="auto+fsdp", remat=remat).peak_bytes for n in (2, 4, 8)}
    assert peaks[2] >= peaks[4] >= peaks[8], {n: f"{p / 1e6:.1f} MB" for n, p in peaks.items()}
