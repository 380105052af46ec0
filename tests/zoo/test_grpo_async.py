"""Asynchronous GRPO (``redco_zoo_grpo.async_rollouts``): the TIS weights and the weighted loss
are Yao et al.'s formula written out in numpy; with ``--rollout_devices 4
--max_off_policy_steps 1`` the trainer gets 4 devices and the engine the other 4, each round's
samples were drawn by params exactly one update old (after the first), the next round's rollout
is dispatched before the update and runs while it does; a run stopped by SIGTERM, then SIGKILLed,
resumes to the bits of one never stopped; DAPO's dynamic sampling draws its extra prompts on
the rollout mesh and keeps the groups the synchronous rule keeps; bad flags are refused before
anything loads;
``--rollout_devices auto`` (``rollout_split.py``; its picks: ``test_grpo_split.py``) is refused
before loading where no split fits and otherwise trains on the split it logged."""
import json
import os
import random

import jax.numpy as jnp
import numpy as np
import pytest
from test_grpo import (  # noqa: F401 (warmed_up: the SFT'd model, a fixture)
    GRPO_FLAGS,
    STOPPING_REWARD,
    a_dapo_grpo,
    assert_same_run,
    cli_cmd,
    grpo_args,
    grpo_env,
    kill_at_random,
    never_stopped,
    round_seconds,
    said_resumed,
    stopped_by_sigterm_in_round_2,
    warmed_up,
)

from redco.cli import main
from redco_zoo_grpo.async_rollouts import AsyncConfig, is_weights
from redco_zoo_grpo.loss import average, token_losses


def test_tis_weights_and_the_weighted_loss_are_the_formula():
    """``w = min(pi_old / pi_rollout, C)`` on counted tokens, its untruncated mean, max and
    truncated share over them; the loss of each token multiplied by its ``w`` (GRPO's
    average), as written out in numpy."""
    rng = np.random.default_rng(0)
    old, rollout = rng.normal(-2, 1, (4, 6)), rng.normal(-2, 1, (4, 6))
    mask = np.arange(6) < np.array([[6], [3], [1], [5]])
    weights, metrics = is_weights(old, rollout, mask, 2.0)
    ratio = np.exp(old - rollout)
    expect = np.where(mask, np.minimum(ratio, 2.0), 1.0)
    np.testing.assert_allclose(weights, expect, rtol=1e-6)
    assert 0 < (ratio[mask] > 2).mean() < 1  # the cap binds on some counted tokens, not all
    np.testing.assert_allclose([metrics["is_ratio_mean"], metrics["is_ratio_max"],
                                metrics["is_truncated"]],
                               [ratio[mask].mean(), ratio[mask].max(), (ratio[mask] > 2).mean()])
    logps, adv = old + rng.normal(0, 0.3, old.shape), np.array([1.0, -1.0, 0.5, -2.0])
    batch = {"old_logps": jnp.asarray(old, jnp.float32), "advantage": jnp.asarray(adv, jnp.float32),
             "is_weight": jnp.asarray(weights), "completion_mask": jnp.asarray(mask)}
    value = average(token_losses(jnp.asarray(logps, jnp.float32), batch, 0.2, 0.28, 0.0),
                    batch["completion_mask"], "grpo")
    r = np.exp(logps - old)
    surrogate = np.minimum(r * adv[:, None], np.clip(r, 0.8, 1.28) * adv[:, None])
    expect = -np.mean((surrogate * expect * mask).sum(1) / mask.sum(1))
    np.testing.assert_allclose(float(value), expect, rtol=1e-5)


ASYNC_FLAGS = ["--rollout_devices", "4", "--max_off_policy_steps", "1"]


def async_args(root, workdir, reward, k: int = 1) -> list[str]:
    """``grpo_args``' three rounds (4 updates each, minibatches of 64, a checkpoint every 2
    rounds) with K = ``k`` on 4 + 4 devices."""
    return grpo_args(root, workdir, reward) + ["--per_device_batch_size", "16", *ASYNC_FLAGS,
                                               "--max_off_policy_steps", str(k)]


@pytest.fixture(scope="module")
def one_behind(warmed_up, tmp_path_factory):  # noqa: F811
    """``async_args``' run with K = 1, never stopped, in this process: the rounds read by the
    K = 1 test and the run the stopped one resumes to. Its workdir and reward file."""
    return never_stopped(async_args, warmed_up, tmp_path_factory.mktemp("async_whole"))


def assert_rounds_run_k_updates_behind(workdir, k: int) -> None:
    """The 3 rounds of ``workdir``: on 4 + 4 devices; sampled by params ``k`` updates old after
    round 1 (their version and lag logged); the TIS ratio off 1 once the samples' params are
    behind, else 1 (to the engine's numerics); each rollout after the first dispatched before
    the previous round's update and started while it ran (K = 1), or after it (K = 0)."""
    log = (workdir / "log.txt").read_text()
    assert "mesh: {'dp': 4, 'mp': 1}" in log and "1, 4 replicas" in log, log[:3000]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    rounds = [r for r in rows if "rollout/policy_lag" in r]
    assert [r["rollout/policy_version"] for r in rounds] == [max(0, t - 1 - k) for t in (1, 2, 3)]
    assert [r["rollout/policy_lag"] for r in rounds] == [0] + [k] * 2, rounds
    off = [abs(r["rollout/is_ratio_max"] - 1) for r in rounds]
    assert off[0] < 1e-5 and (max(off[1:]) > 1e-3 if k else max(off) < 1e-5), off
    timeline = [json.loads(line) for line in open(workdir / "timeline.jsonl")]
    assert [t["round"] for t in timeline] == [1, 2, 3]
    for before, after in zip(timeline, timeline[1:]):
        if k:
            assert after["rollout_dispatch"] <= before["update_dispatch"], (before, after)
            assert after["rollout_start"] < before["update_ready"], (before, after)
        else:
            assert after["rollout_dispatch"] >= before["update_ready"], (before, after)


def test_rollouts_run_one_update_ahead_on_devices_of_their_own(one_behind):
    """K = 1, 3 rounds on 4 + 4 devices: rounds 2 and 3 train on samples of the params one
    update old (versions 0, 0, 1), each next rollout dispatched before the update and running
    while it does (``assert_rounds_run_k_updates_behind``)."""
    assert_rounds_run_k_updates_behind(one_behind[0], k=1)


def test_rollouts_with_k_0_wait_for_each_update(warmed_up, tmp_path):  # noqa: F811
    """K = 0, the same run otherwise (its compiled programs those of the K = 1 run): every
    round on-policy (versions 0, 1, 2), the TIS ratio 1, each rollout after the update before
    it."""
    (tmp_path / "rewards.py").write_text(STOPPING_REWARD)
    main(async_args(warmed_up, tmp_path / "k0", tmp_path / "rewards.py", k=0))
    assert_rounds_run_k_updates_behind(tmp_path / "k0", k=0)


# The SIGKILL phase runs with REDCO_SLOW_TESTS=1: a kill at a random moment of the last round
# and the resume from the checkpoint before it are the synchronous loop's, killed in CI by
# test_grpo.py's test_a_grpo_run_stopped_by_sigterm_or_killed_resumes_to_the_same_bits; an
# asynchronous run SIGKILLed after a checkpoint holding a rollout in flight resumes to the same
# bits in CI on 2 processes (tests/multihost/test_grpo_async_processes.py).
KILLED = os.environ.get("REDCO_SLOW_TESTS") == "1"


def test_async_grpo_stopped_by_sigterm_or_killed_resumes_to_the_same_bits(
        warmed_up, one_behind, tmp_path, monkeypatch):  # noqa: F811
    """K = 1 on 4 + 4 devices: SIGTERM in round 2 (of 3) saves step 8 with round 3's rollout
    in flight, exit 143; (with ``KILLED``) the rerun, a process of its own, is SIGKILLed at a
    random moment of round 3; the next ends with the params, rollout metrics, losses and
    held-out rewards of the run never stopped."""
    whole, reward = one_behind
    cut = tmp_path / "cut"
    stopped_by_sigterm_in_round_2(async_args(warmed_up, cut, reward), cut, monkeypatch)
    seed = int.from_bytes(os.urandom(4), "little")
    killed = KILLED and kill_at_random(
        cli_cmd(async_args(warmed_up, cut, reward)),
        said_resumed(str(cut)), round_seconds(whole), random.Random(seed), grpo_env())
    main(async_args(warmed_up, cut, reward))
    log = (cut / "log.txt").read_text()
    assert killed == KILLED and log.count("Resumed from") == 1 + KILLED, (seed, killed,
                                                                          log[-2000:])
    assert_same_run(whole, cut, ("rollout/reward", "rollout/is_ratio_max",
                                 "rollout/clip_fraction", "eval/reward", "train/loss"),
                    f"seed {seed}, killed {killed}")


@pytest.mark.slow  # REDCO_SLOW_TESTS=1 (conftest.py)
def test_one_update_behind_grpo_learns_the_tutorial_task_as_on_policy_grpo_does(warmed_up,  # noqa: F811
                                                                               tmp_path):
    """The tutorial's GRPO command (docs/tutorials/post-training.md) with K = 1 on 4 + 4
    devices, 40 rounds: the greedy held-out reward rises from <= 0.1 to >= 0.5 (one seed
    measured: 0.69 by round 30, as K = 0 on the same devices), the TIS weights truncating
    some tokens along the way."""
    main(["zoo", "run", "grpo", "--model", str(warmed_up / "sft" / "model"), "--train",
          str(warmed_up / "prompts.jsonl"), "--eval", str(warmed_up / "prompts_held_out.jsonl"),
          "--workdir", str(tmp_path / "k1"), "--n_rounds", "40", "--per_device_batch_size", "4",
          *GRPO_FLAGS, *ASYNC_FLAGS])
    rows = [json.loads(line) for line in open(tmp_path / "k1" / "metrics.jsonl")]
    greedy = [r["eval/reward"] for r in rows if "eval/reward" in r]
    assert greedy[0] <= 0.1 and greedy[-1] >= 0.5, greedy
    assert max(r.get("rollout/is_truncated", 0) for r in rows) > 0


def test_auto_refuses_before_loading_and_runs_grpo_on_the_split_it_picked(
        warmed_up, tmp_path, capsys):  # noqa: F811
    """A model directory without its weights and 1 MB a device: refused (exit 2) naming the
    fix, so nothing was loaded. Then 2 rounds on the warmed-up model with ``auto`` and
    K = 1: the log holds the candidates' table and the pick, the trainer's mesh is the other
    8 - N devices and the rounds train one version behind. Minibatches of 128 a device: only
    N = 6 and 7 split a round's 256 samples, so two candidates are compiled, not three."""
    model = warmed_up / "sft" / "model"
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            (bare / f.name).write_bytes(f.read_bytes())
    flags = ["--train", str(warmed_up / "prompts.jsonl"), "--n_rounds", "2",
             "--per_device_batch_size", "128", "--eval_every_n_rounds", "2", *GRPO_FLAGS,
             "--rollout_devices", "auto", "--max_off_policy_steps", "1",
             "--decode_model_shards", "1"]
    with pytest.raises(SystemExit) as stop:
        main(["zoo", "run", "grpo", "--model", str(bare), "--workdir", str(tmp_path / "no"),
              "--device_memory", "1MB", *flags])
    assert stop.value.code == 2
    assert "no split of the 8 devices fits" in capsys.readouterr().err
    workdir = tmp_path / "auto"
    main(["zoo", "run", "grpo", "--model", str(model), "--workdir", str(workdir),
          "--device_memory", "1GB", *flags])
    out = capsys.readouterr().out
    n = int(out.split("planned before loading: --rollout_devices ")[1].split(",")[0])
    assert 0 < n < 8 and "<- pick" in out and "why: N=" in out, out[-3000:]
    log = (workdir / "log.txt").read_text()
    assert f"mesh: {{'dp': {8 - n}, 'mp': 1}}" in log and f"1, {n} replicas" in log, log[:3000]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["rollout/policy_lag"] for r in rows if "rollout/policy_lag" in r] == [0, 1]


def test_dynamic_sampling_draws_more_on_the_rollout_mesh_by_dapos_rule(warmed_up, tmp_path):  # noqa: F811
    """DAPO's dynamic sampling with rollouts on 4 devices of their own (``a_dapo_grpo``'s
    prompts and rewards): the round's first draw dispatched ahead on version 0 has 1 group
    with signal, so 4 more prompts are drawn then, on the rollout mesh, on the version
    published last (1); the round trains exactly the synchronous rule's groups (``test_grpo``'s
    ``test_dapos_dynamic_sampling_...``: prompts 1, 4, 5, 7), each sample with its own version
    and the TIS weight of its own rollout log-probabilities (the formula)."""
    grpo, prompts, rows = a_dapo_grpo(warmed_up, tmp_path, AsyncConfig(4, 1))
    engine = grpo.engine
    engine.publish(grpo.trainer.state.params, 0)
    engine.feed(lambda: [0, 1, 2, 3], lambda picked: [prompts[i] for i in picked], 1)
    engine.ahead(1)  # round 1's first draw, on version 0
    engine.publish(grpo.trainer.state.params, 1)  # (the same params, a newer version)
    more = iter([(prompts[4:], rows[4:])])
    samples, metrics = grpo.rollout(prompts[:4], rows[:4], "prompt", 1, lambda: next(more))
    trained = [int(np.flatnonzero([(s["prompt_ids"] == p["prompt_ids"]).all()
                                   for p in prompts])[0]) for s in samples[::4]]
    assert trained == [1, 4, 5, 7] and all(s["advantage"] != 0 for s in samples)
    assert (metrics["prompts_drawn"], metrics["groups_dropped"]) == (8, 4)
    assert [int(s["policy_version"]) for s in samples[::4]] == [0, 1, 1, 1]
    assert (metrics["policy_version"], metrics["policy_lag"]) == (0, 0)
    for s in samples:
        ratio = np.exp(s["old_logps"].astype(np.float64) - s["rollout_logps"])
        np.testing.assert_allclose(s["is_weight"], np.where(
            s["completion_mask"], np.minimum(ratio, 2.0), 1.0), rtol=1e-6)


@pytest.mark.parametrize("flags, says", [
    (["--rollout_devices", "8"], "--rollout_devices 8: of the 8 devices, give 1 to 7"),
    (["--max_off_policy_steps", "1"], "give --rollout_devices N too"),
    (["--rollout_devices", "2", "--engine_rows", "0"], "does not run with --engine_rows 0"),
    (["--rollout_devices", "2", "--environment", "calculator"], "does not run with --environment"),
    (["--rollout_devices", "2", "--is_cap", "0.5"], "--is_cap 0.5: the TIS weights"),
])
def test_bad_async_flags_are_refused_before_anything_loads(tmp_path, capsys, flags, says):
    with pytest.raises(SystemExit):
        main(["zoo", "run", "grpo", "--model", str(tmp_path / "missing"), "--train",
              str(tmp_path / "missing.jsonl"), "--workdir", str(tmp_path / "w"), *flags])
    assert says in capsys.readouterr().err


def test_a_trainer_holding_the_rollout_devices_is_refused_naming_the_fix():
    """A ``GRPO`` made in Python with a Deployer over every device and ``rollout_devices``:
    the two meshes would share devices, so it is refused, naming the ``Deployer``'s
    ``devices`` to give."""
    import jax

    from redco.protocols import UsageError
    from redco_zoo_grpo.async_rollouts import rollout_devices
    training, rollout = rollout_devices(3, jax.devices()[:5])
    assert training == jax.devices()[:5] and rollout == jax.devices()[5:]
    with pytest.raises(UsageError, match=r"make it with devices=training_devices\(3\)"):
        rollout_devices(3, jax.devices())
