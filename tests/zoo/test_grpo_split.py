"""The planner's rollout split (``redco_zoo_grpo.rollout_split``, ``--rollout_devices auto``):
on 8 devices, a round that is mostly sampling (long completions, few engine rows) gets more
rollout devices than one that is mostly updating (4 epochs over short completions); a trainer
that fits only on enough devices bounds N; no split fitting is refused before loading, naming
the fix; ``redco plan --rollout_devices auto`` prints the table (``redco zoo run grpo
--rollout_devices auto`` end to end: ``test_grpo_async.py``, beside its warmed-up model).

The expectations are written here from the round-time model (module docstring of
``rollout_split``): with K = 1 the round is ``max(rollout(N), update(8 - N))``; a rollout's
work shrinks with the replicas decoding its rows, an update's with the devices splitting its
minibatches. Each pick compiles 6 programs of a 2-layer width-64 model (decode step, prefill
and train step at N = 2 and 6), about 20 s of CPU a case under CI's unoptimised XLA flags."""
import json

import jax
import pytest

from redco.cli import main
from redco.protocols import UsageError
from redco_zoo_grpo.auto_split import abstract_decoder, grpo_loss
from redco_zoo_grpo.pipeline import loss_fn
from redco_zoo_grpo.rollout_split import RoundShape, plan_split
from redco_zoo_models.toy import save_tiny_chat_model

# 8 prompts x 12 samples of 384 new tokens after 12 prompt tokens, 12 engine rows (2 a replica
# at N = 6), minibatches of 4 rows a training device
SAMPLING = RoundShape(prompts=8, samples=12, prompt_len=12, new_tokens=384, engine_rows=12,
                      per_device_batch_size=4)
UPDATING = RoundShape(prompts=8, samples=12, prompt_len=12, new_tokens=384, engine_rows=12,
                      per_device_batch_size=4, n_updates=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny chat model's abstract decoder and GRPO loss (its config.json alone is read)."""
    path = save_tiny_chat_model(str(tmp_path_factory.mktemp("split") / "tiny"),
                                [f"w{i}" for i in range(40)])
    model, apply_fn, params, _ = abstract_decoder(path)
    return path, model, params, grpo_loss(loss_fn, apply_fn)


def split_of(tiny, shape, memory=2 ** 30, counts=(2, 6), lines=None):
    _, model, params, loss = tiny
    return plan_split(model, params, loss, shape, memory, 1, decode_degree=1,
                      counts=list(counts), log=[].append if lines is None else lines.append)


@pytest.mark.parametrize("shape, expect", [(SAMPLING, 6), (UPDATING, 2)])
def test_a_sampling_heavy_round_gets_more_rollout_devices_than_an_update_heavy_one(
        tiny, shape, expect):
    """Sampling-heavy: the rollout on 2 devices is the longest side of any split, so 6 sample;
    update-heavy (4 epochs): the update on 2 devices is, so 2 sample. Each candidate's round
    is the K = 1 formula of its two sides."""
    lines = []
    split = split_of(tiny, shape, lines=lines)
    assert split.rollout_devices == expect, lines[-1]
    by_n = {c.n: c for c in split.candidates}
    assert all(c.rollout.fits and c.update.fits for c in split.candidates)
    for c in split.candidates:
        assert c.round_seconds(1) == max(c.rollout.seconds, c.update.seconds)
        assert c.round_seconds(0) == c.rollout.seconds + c.update.seconds
    # a side's work shrinks with its devices: the rollout on 6 < on 2, the update on 6 < on 2
    assert by_n[6].rollout.seconds < by_n[2].rollout.seconds
    assert by_n[2].update.seconds < by_n[6].update.seconds
    heavy = by_n[2].rollout.seconds if expect == 6 else by_n[6].update.seconds
    assert heavy == max(max(c.rollout.seconds, c.update.seconds) for c in split.candidates)
    assert "<- pick" in lines[-1].splitlines()[1 + [2, 6].index(expect)]


def test_a_trainer_that_fits_only_on_enough_devices_bounds_the_rollout_devices(tiny, tmp_path):
    """The tiny model at width 192 (its FSDP-split state divides over 2 and 6 devices): the
    sampling-heavy round picks N = 6 with room (measured: round 7.2 ms against 8.3 at N = 2).
    With one device's usable memory between the update's compiled peak over 6 training
    devices and over 2 (``auto+fsdp``: the state split over dp; measured 122.8 and 126.5 MiB),
    the trainer fits only on 6, so N = 6 does not fit and N = 2 is picked."""
    config = json.loads(open(f"{tiny[0]}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, hidden_size=192,
                                                          intermediate_size=768)))
    model, apply_fn, params, _ = abstract_decoder(str(tmp_path))
    wide = (None, model, params, grpo_loss(loss_fn, apply_fn))
    shape = RoundShape(**{**SAMPLING.__dict__, "sharding_rules": "auto+fsdp"})
    roomy = split_of(wide, shape)
    peaks = {c.n: c.update.peak_bytes for c in roomy.candidates}
    assert roomy.rollout_devices == 6 and peaks[6] > peaks[2], peaks
    usable = (peaks[2] + peaks[6]) // 2
    assert max(c.rollout.peak_bytes for c in roomy.candidates) < usable
    bounded = split_of(wide, shape, memory=int(usable / 0.9) + 1)
    by_n = {c.n: c for c in bounded.candidates}
    assert not by_n[6].update.fits and by_n[2].update.fits
    assert bounded.rollout_devices == 2


def test_no_split_that_fits_is_refused_naming_the_fix(tiny):
    """1 MiB a device holds neither side's compiled program (nothing is compiled past the
    state's bytes): refused, naming the levers."""
    lines = []
    with pytest.raises(UsageError, match=r"--rollout_devices auto: no split of the 8 devices "
                       r"fits .* lower --engine_rows or --per_device_batch_size, train LoRA "
                       r"adapters \(--lora_rank\), .*\(--rollout_devices 0\)"):
        split_of(tiny, SAMPLING, memory=2 ** 20, lines=lines)
    assert "over" in lines[-1]


def test_redco_plan_prints_the_split_for_a_grpo_shape(tiny, capsys):
    """``redco plan --rollout_devices auto`` for a round of the tiny model: the table of the
    N whose trainers split 96 samples into minibatches of 48 a device (6 and 7, on 2 and 1
    training devices; the others named as not, nothing compiled for them), the pick the
    lesser round of the two."""
    path = tiny[0]
    assert jax.device_count() == 8
    main(["plan", "--model", path, "--devices", "8", "--device_memory", "1GB",
          "--rollout_devices", "auto", "--seq_len", "12", "--prompts_per_round", "8",
          "--n_samples", "12", "--max_new_tokens", "8", "--engine_rows", "12",
          "--per_device_batch_size", "48", "--decode_model_shards", "1"])
    out = capsys.readouterr().out
    assert "GRPO rounds of 8 prompts x 12 samples x 8 new tokens" in out
    table = out.split("round\n")[1].split("planned")[0].splitlines()
    rounds = {int(line.split()[0]): float(line.split("ms")[-2].split()[-1]) for line in table
              if "fits" in line and "over" not in line}
    assert sorted(rounds) == [6, 7], out
    assert "not in minibatches of" in out
    pick = int(out.split("planned before loading: --rollout_devices ")[1].split(",")[0])
    assert rounds[pick] == min(rounds.values()), out
