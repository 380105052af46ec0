"""The depth-extrapolation rule of the AOT tables (``bench/depth_rule.py``, ``bench/cut_decoders.py``;
BENCHMARKS.md sections 27 and 31) on given numbers: nothing is compiled (well under a second).
Its accuracy against full-depth compiles is ``bench/depth_rule_check.py``'s table."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from cut_decoders import cut_kinds, extrapolated_peak, growth  # noqa: E402
from depth_rule import Compiled, full_peak, layer_growth  # noqa: E402

S, F = "sliding_attention", "full_attention"


def test_a_further_layer_adds_its_measured_growth_or_at_least_its_gradients():
    one, two = Compiled(peak=1000, state=100), Compiled(peak=1300, state=130)  # rest 900, 1170
    assert layer_growth(one, two, grads=10) == 270
    assert layer_growth(one, two, grads=400) == 400  # remat: growth is noise below the grads
    assert full_peak(5000, two, [(14, 270)]) == 5000 + 1170 + 14 * 270
    with pytest.raises(ValueError, match="deeper than the model"):
        full_peak(5000, two, [(-1, 270)])


def test_the_gradient_floor_is_the_trainable_bytes_not_the_frozen_ones():
    """LoRA: a layer adds frozen params (in the state) and two AdamW moments of its adapters;
    its fp32 gradients are the adapters' bytes, (state growth - params growth) / 2."""
    one = {"peak": 1000, "state": 100, "params": 90}
    two = {"peak": 1101, "state": 200, "params": 180}  # rest 900 -> 901; adapters 5 bytes
    assert growth(one, two) == 5
    full = {"peak": 1000, "state": 100, "params": 90}  # full fine-tuning: grads = params
    assert growth(full, {"peak": 1200, "state": 370, "params": 180}) == 90


def test_each_layer_kind_adds_its_own_growth():
    """Gemma-3-1B: 26 layers, every sixth global (4), the others sliding (22); the cuts are
    [S, S, S], + S, + F, and the 22 layers beyond [S, S, S, S] add 18 sliding and 4 global
    growths."""
    base = (S, S, S)
    assert cut_kinds("gemma-3-1b") == [base, base + (S,), base + (F,)]
    cuts = {",".join(base): {"peak": 1000, "state": 100, "params": 100},
            ",".join(base + (S,)): {"peak": 1150, "state": 150, "params": 150},  # growth 100
            ",".join(base + (F,)): {"peak": 1450, "state": 150, "params": 150}}  # growth 400
    assert extrapolated_peak("gemma-3-1b", 10_000, cuts) == 10_000 + 1000 + 18 * 100 + 4 * 400
    del cuts[",".join(base + (F,))]  # a cut over the memory: no peak
    assert extrapolated_peak("gemma-3-1b", 10_000, cuts) is None


def test_a_model_of_one_kind_extends_its_deepest_cut():
    """Llama-3.2-1B: 16 layers of one kind, cut at 3 and 4: 12 further layers."""
    assert [len(kinds) for kinds in cut_kinds("llama-3.2-1b")] == [3, 4]
    three, four = (",".join(kinds) for kinds in cut_kinds("llama-3.2-1b"))
    cuts = {three: {"peak": 1000, "state": 100, "params": 100},
            four: {"peak": 1120, "state": 130, "params": 130}}
    assert extrapolated_peak("llama-3.2-1b", 7_000, cuts) == 7_000 + 990 + 12 * 90
