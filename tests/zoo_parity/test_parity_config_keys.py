"""Every key transformers' config class of a zoo family defines (its fields and its
``attribute_map`` aliases) is one the zoo reads for that family, one that changes nothing
(``HARMLESS``), or one it refuses when set (``COMPUTING``): none can pass as metadata and be
dropped with only a warning (``redco_zoo_models.config_keys``)."""
import pytest
from parity import transformers

from redco_zoo_models import config_keys
from redco_zoo_models.families import COMMON, COMPUTING, FAMILIES, ROPE_KEYS


@pytest.mark.parametrize("model_type", FAMILIES)
def test_no_key_of_the_familys_transformers_config_passes_as_metadata(model_type):
    config = transformers.AutoConfig.for_model(model_type)
    keys = set(config.to_dict()) | set(getattr(type(config), "attribute_map", {}))
    read = config_keys.read_keys(FAMILIES[model_type], COMMON, ROPE_KEYS)
    metadata = sorted(keys - read - config_keys.HARMLESS - COMPUTING)
    assert not metadata, f"{model_type}: transformers defines {metadata}; the zoo would drop them"
