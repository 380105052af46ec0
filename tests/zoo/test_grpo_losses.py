"""GRPO's four losses against their formulas written out here in numpy (value and gradient: the
ratio's normalisation per token or per sequence, the clip ranges the papers publish, where the
gradient flows), and DAPO's rollout pieces: dynamic sampling keeps exactly the groups with
signal and draws more, overlong filtering masks exactly the cut completions, the soft overlong
punishment has the paper's values; bad settings are refused naming the fix."""
import jax
import numpy as np
import pytest
from test_sft import SPECIALS, WORDS

from redco.cli import main
from redco.protocols import UsageError
from redco_zoo_grpo import loss_fn
from redco_zoo_grpo.config import GRPOConfig
from redco_zoo_grpo.dapo import (
    PromptStream,
    filter_overlong,
    select_groups,
    signal_groups,
    soft_overlong_penalty,
)
from redco_zoo_grpo.loss import average, group_advantages, token_logps, token_losses
from redco_zoo_grpo.rollout import completion_mask

EOS = SPECIALS.index("<|im_end|>")
# the clip ranges the papers publish: PPO/GRPO 0.2; DAPO's clip-higher 0.28 (arXiv 2503.14476);
# GSPO's 3e-4 and 4e-4 (arXiv 2507.18071, section 5.1)
PUBLISHED = {"grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "dapo": (0.2, 0.28),
             "gspo": (3e-4, 4e-4)}
# four completions of 5 tokens: the first cut at max_new_tokens (no EOS), the others ended early
TOKENS = np.array([[9, 12, 14, 15, 16], [5, 6, EOS, 0, 0], [8, 9, 10, EOS, 0],
                   [11, EOS, 0, 0, 0]], np.int32)
ADVANTAGES = np.array([1.5, 0.5, -1.0, -0.7])
# log-ratios per token (after EOS: garbage that must not count); picked so that every clip case
# occurs: 1.25 inside [0.8, 1.28] only with clip-higher, 1.4 and 0.7 past both ends under either
# sign of the advantage, 1.22 clipped by 0.2 but not by 0.28
LOG_RATIOS = np.log([[1.25, 1.4, 0.7, 1.05, 0.9], [1.1, 0.95, 1.22, 20.0, 0.05],
                     [0.7, 1.4, 1.0, 1.1, 50.0], [0.79, 1.05, 9.0, 9.0, 9.0]])
# GSPO's case: each completion's mean log-ratio, around its tiny range [1 - 3e-4, 1 + 4e-4]:
# inside (A > 0), above (A > 0: clipped), below (A < 0: clipped), above (A < 0: not clipped)
SEQUENCE_MEANS = np.array([2e-4, 1e-3, -1e-3, 1e-3])


def gspo_log_ratios(mask):
    """The tokens' log-ratios scattered as ``LOG_RATIOS`` but averaging ``SEQUENCE_MEANS``."""
    mean = (LOG_RATIOS * mask).sum(1) / mask.sum(1)
    return LOG_RATIOS - mean[:, None] + SEQUENCE_MEANS[:, None]


def reference(loss_type, log_ratios, mask, adv, low, high):
    """The loss and its gradient in the log-probabilities, as the papers write them."""
    batch, width = mask.shape
    lengths = mask.sum(1)
    if loss_type == "gspo":  # s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|)
        s = np.exp((log_ratios * mask).sum(1) / lengths)
        plain, clipped = s * adv, np.clip(s, 1 - low, 1 + high) * adv
        value = -np.mean(np.minimum(plain, clipped))  # -(1/G) sum_i min(...)
        flows = ((s >= 1 - low) & (s <= 1 + high)) | (plain < clipped)
        grad = -(flows * adv * s / lengths / batch)[:, None] * mask  # d s_i = s_i mean_t d logp_t
        return value, grad, flows
    r = np.exp(log_ratios)
    a = adv[:, None]
    plain, clipped = r * a, np.clip(r, 1 - low, 1 + high) * a
    weight = {"grpo": 1 / (batch * lengths[:, None]) * np.ones_like(r),  # per completion
              "dr_grpo": np.full_like(r, 1 / (batch * width)),  # a constant
              "dapo": np.full_like(r, 1 / mask.sum())}[loss_type]  # per token
    value = -(np.minimum(plain, clipped) * mask * weight).sum()
    flows = ((r >= 1 - low) & (r <= 1 + high)) | (plain < clipped)
    return value, -(flows * a * r * mask * weight), flows


class LogitsAreParams:  # a "model" whose logits are its params: (B, T, V) for ids (B, T)
    apply_fn = staticmethod(lambda params, ids, segment_ids: params[:, :ids.shape[1]])


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_each_loss_and_its_gradient_are_its_papers_formula(loss_type):
    """``loss_fn`` under each ``--loss`` with its default clip range (the published one) gives
    the formula's value; the gradient in the log-probabilities is the formula's: under GSPO one
    ratio per completion, differentiated through (no stop-gradient), each counted token getting
    ``-A s / (G |y|)`` where the clip lets it flow and 0 where it binds or after the EOS."""
    config = GRPOConfig(loss_type=loss_type)
    assert (config.clip_low, config.clip_high) == PUBLISHED[loss_type]
    mask = completion_mask(TOKENS, EOS)
    log_ratios = gspo_log_ratios(mask) if loss_type == "gspo" else LOG_RATIOS
    batch = {"prompt_ids": np.full((4, 3), 7, np.int32), "prompt_mask": np.ones((4, 3), bool),
             "tokens": TOKENS, "completion_mask": mask,
             "advantage": ADVANTAGES.astype(np.float32)}
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 7, len(SPECIALS) + len(WORDS)))
    logps = np.asarray(token_logps(LogitsAreParams.apply_fn, logits, batch, 1.0), np.float64)
    batch["old_logps"] = (logps - log_ratios).astype(np.float32)
    value, grad, flows = reference(loss_type, logps - batch["old_logps"], mask, ADVANTAGES,
                                   *PUBLISHED[loss_type])
    got = loss_fn(None, LogitsAreParams, logits, batch, True, **config.loss_kwargs())
    assert float(got) == pytest.approx(value, rel=2e-5)

    def loss_of_logps(logps):
        per_token = token_losses(logps, batch, config.clip_low, config.clip_high, 0.0,
                                 sequence=loss_type == "gspo")
        return average(per_token, mask, loss_type)
    got_grad = jax.grad(loss_of_logps)(logps.astype(np.float32))
    np.testing.assert_allclose(got_grad, grad, rtol=1e-4, atol=1e-8)
    if loss_type == "gspo":  # every clip case met: inside, clipped above and below, let through
        assert flows.tolist() == [True, False, False, True]
    else:
        assert flows[mask].any() and not flows[mask].all()
    adv_rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    centred = adv_rewards - adv_rewards.mean(1, keepdims=True)
    scale = 1.0 if loss_type == "dr_grpo" else adv_rewards.std(1, keepdims=True) + 1e-4
    np.testing.assert_allclose(group_advantages(adv_rewards, loss_type), centred / scale)


def test_the_losses_differ_where_their_papers_do():
    """Same tokens, same ratios: the published clip ranges and normalisations give four
    different losses (a variant silently falling back to another's formula would not)."""
    mask = completion_mask(TOKENS, EOS)
    values = {lt: reference(lt, LOG_RATIOS, mask, ADVANTAGES, *PUBLISHED[lt])[0]
              for lt in PUBLISHED}
    assert len({round(v, 6) for v in values.values()}) == 4, values


def test_overlong_filtering_masks_exactly_the_completions_cut_at_max_new_tokens():
    mask = completion_mask(TOKENS, EOS)
    assert filter_overlong(mask, TOKENS, EOS).tolist() == [
        [False] * 5, [True] * 3 + [False] * 2, [True] * 4 + [False], [True] * 2 + [False] * 3]


def test_the_soft_overlong_punishment_is_zero_then_linear_to_minus_one():
    """DAPO's R_length with L_max = 16, L_cache = 4: 0 up to 12 tokens, (12 - |y|) / 4 up to
    16, -1 beyond."""
    lengths = np.array([1, 12, 13, 14, 15, 16, 20])
    np.testing.assert_allclose(soft_overlong_penalty(lengths, 16, 4),
                               [0, 0, -0.25, -0.5, -0.75, -1, -1])


def test_dynamic_sampling_keeps_the_first_groups_with_signal_and_fills_only_when_short():
    rewards = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1], [0.5, 0.2, 0.5, 0.5],
                        [1, 0, 1, 1], [0.5, 0.5, 0.5, 0.5]])
    signal = signal_groups(rewards)
    assert signal.tolist() == [False, True, False, True, True, False]
    assert select_groups(signal, 2).tolist() == [1, 3]
    assert select_groups(signal, 3).tolist() == [1, 3, 4]
    assert select_groups(signal, 5).tolist() == [0, 1, 2, 3, 4]  # short: first dropped fill


def test_the_prompt_stream_resumes_where_it_stood():
    """Prompts in epoch permutations seeded by [seed, epoch], as GRPO's rounds always took them;
    a stream rebuilt at a checkpoint's position hands out what the uninterrupted one did."""
    whole = PromptStream(10, seed=3, per_take=4)
    taken = [whole.take() for _ in range(5)]  # 20 prompts: two epochs
    expected = np.concatenate([np.random.default_rng([3, e]).permutation(10) for e in (0, 1)])
    assert sum(taken, []) == expected.tolist()
    resumed = PromptStream(10, seed=3, per_take=4, position=12)
    assert [resumed.take(), resumed.take()] == taken[3:]


@pytest.mark.parametrize("settings, message", [
    (dict(clip_low=0.0), r"--clip_low 0.0 --clip_high 0.2: .* give 0 < clip_low < 1"),
    (dict(loss_type="gspo", clip_high=-1e-4), r"clip_high > 0 \(--loss gspo's defaults: "
                                               r"\(0.0003, 0.0004\)\)"),
    (dict(clip_low=1.0), r"give 0 < clip_low < 1"),
    (dict(max_sampling_draws=0), r"--max_sampling_draws 0: .* give 1 or more"),
    (dict(overlong_buffer=65), r"--overlong_buffer 65: .* give 0 \(off\) to 64"),
])
def test_bad_settings_are_refused_naming_the_fix(settings, message):
    with pytest.raises(UsageError, match=message):
        GRPOConfig(**settings)


def test_a_bad_clip_range_on_the_command_line_is_refused_before_anything_loads(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["zoo", "run", "grpo", "--model", str(tmp_path / "missing"), "--train",
              str(tmp_path / "missing.jsonl"), "--workdir", str(tmp_path / "w"), "--loss", "gspo",
              "--clip_low", "0"])
    assert "--clip_low 0.0 --clip_high 0.0004: the ratio is clipped to [1 - clip_low, " \
        "1 + clip_high]; give 0 < clip_low < 1" in capsys.readouterr().err


def test_dapo_turns_on_its_recipe_and_each_piece_switches_off():
    dapo = GRPOConfig(loss_type="dapo")
    assert dapo.dynamic_sampling and dapo.overlong_filter
    assert (dapo.clip_low, dapo.clip_high) == (0.2, 0.28)
    off = GRPOConfig(loss_type="dapo", dynamic_sampling=False, overlong_filter=False,
                     clip_high=0.2)
    assert not off.dynamic_sampling and not off.overlong_filter and off.clip_high == 0.2
    grpo = GRPOConfig()
    assert not grpo.dynamic_sampling and not grpo.overlong_filter and grpo.overlong_buffer == 0
