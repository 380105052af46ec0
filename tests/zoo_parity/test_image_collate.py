"""Image + text examples collated by the model's own transformers processor
(``redco_zoo_models.image_collate``), from PNG files written here: the arrays are the
processor's own, padded to ``max_len`` and cut only in text; an unreadable image file, images
and placeholders of different counts, and image tokens past ``max_len`` are refused naming the
example and the fix."""
import numpy as np
import pytest
from PIL import Image
from test_parity_gemma3_vision import IMAGE as GEMMA3_IMAGE
from test_parity_gemma3_vision import gemma3_processor
from test_parity_llava import IMAGE, PAD, processor

from redco_zoo_models.image_collate import collate_images


@pytest.fixture
def png(tmp_path):
    path = tmp_path / "picture.png"
    Image.fromarray((np.random.RandomState(0).rand(40, 48, 3) * 255).astype(np.uint8)).save(path)
    return str(path)


def test_collated_batch_is_the_processors_own_padded_to_max_len(png):
    llava = processor()
    examples = [{"text": "USER: <image> what is in this picture ? ASSISTANT:", "images": [png]},
                {"text": "what is this ?"}]
    got = collate_images(llava, examples, max_len=30)
    want = llava(images=[Image.open(png).convert("RGB")], text=[examples[0]["text"]],
                 return_tensors="np")
    n = want["input_ids"].shape[1]  # 16 image tokens + 8 words
    assert got["input_ids"].shape == (2, 30) and n == 24
    np.testing.assert_array_equal(got["input_ids"][0, -n:], want["input_ids"][0])  # left pads
    assert (got["input_ids"][0, :-n] == PAD).all() and got["attention_mask"][0].sum() == n
    np.testing.assert_array_equal(got["pixel_values"], want["pixel_values"])
    assert (got["input_ids"][1] == IMAGE).sum() == 0 and got["attention_mask"][1].sum() == 4
    # text past max_len is cut; the image tokens are all kept
    cut = collate_images(llava, examples[:1], max_len=20)
    assert cut["input_ids"].shape == (1, 20) and (cut["input_ids"] == IMAGE).sum() == 16


def test_gemma3_examples_carry_token_type_ids(png):
    """Gemma 3's placeholder is ``<start_of_image>``, expanded to 4 soft tokens (which its
    ``token_type_ids`` mark, read both ways by the model) and ``<end_of_image>``."""
    got = collate_images(gemma3_processor(), [{"text": "what is <start_of_image> this ?",
                                               "images": [png]}], max_len=16)
    np.testing.assert_array_equal(got["token_type_ids"], got["input_ids"] == GEMMA3_IMAGE)
    assert got["token_type_ids"].sum() == 4 and got["pixel_values"].shape == (1, 3, 32, 32)
    # "what is" + <start_of_image>, 4 soft tokens, <end_of_image> at 7: max_len 7 would cut it
    with pytest.raises(ValueError, match="reach position 7, past max_len 7"):
        collate_images(gemma3_processor(), [{"text": "what is <start_of_image> this ?",
                                             "images": [png]}], max_len=7)


def test_bad_examples_are_refused_naming_the_fix(png, tmp_path):
    llava = processor()
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    text = "USER: <image> what is in this picture ? ASSISTANT:"
    with pytest.raises(ValueError, match=r"example 1: image .*broken.png' cannot be read .*"
                                         r"give a PNG or JPEG file"):
        collate_images(llava, [{"text": text, "images": [png]},
                               {"text": text, "images": [str(broken)]}], max_len=32)
    with pytest.raises(ValueError, match="example 0 has 2 images and 1 '<image>' placeholders"):
        collate_images(llava, [{"text": text, "images": [png, png]}], max_len=64)
    with pytest.raises(ValueError, match="example 0's image tokens reach position 16, past "
                                         "max_len 12: raise max_len to at least 17"):
        collate_images(llava, [{"text": text, "images": [png]}], max_len=12)
