"""Do the compat04 re-makes of Redco 0.4.23's examples score as well here as on redco 0.4.23?

tests/compat04/ re-makes four of the original examples whose scores are chaotic in the seed:
LoRA/BART (test_lora.py), DP-SGD (test_differential_private_training.py), PPO (test_ppo.py) and
DDPG (test_ddpg.py). This driver runs each script's OWN body (its ``main``, imported from the test
module by path; nothing copied) for N seeds on both sides, each run in its own subprocess:

  old side   ``--old_python`` (a venv with ``redco==0.4.23``, see below)
  new side   this interpreter (this repository's redco, e.g. .tox/compat04/bin/python)

A worker does what tests/compat04/conftest.py does (8 simulated CPU devices, offline hubs,
``jax_default_matmul_precision='highest'``, a fresh working directory), runs one script with one
seed and prints one ``BENCH_RESULT {json}`` line. Run ``i`` uses ``jax_seed=SEEDS[i]`` (42, the
tests' seed, first) and, for DDPG, Python/NumPy seed ``i`` (the replay samples and the exploration
noise; the test's run is run 0). Metrics, as the tests read them:

  lora   validation accuracy after fit's last epoch (chance 1/3)
  dp     test accuracy after the 6th epoch (chance 0.10)
  ppo    mean return over episodes 31-40 of CartPole-v1 (random policy ~22)
  ddpg   greedy return of the final actor on Pendulum-v1 (5 fixed starts; init ~-1604)

``--agreement`` asks instead whether both sides compute the same thing: DDPG's params after its
first 1, 10 and 100 updates from the same seeds, old against new. A difference at float32
rounding that grows with the updates means the spread between runs is chaos amplifying rounding
(8-way sharded sums here, pmap's per-device sums there), not a different algorithm.

Not everything runs on 0.4.23 unchanged, and the output says so per run: LoRA's final
``save_ckpt(float_dtype=jnp.float32)`` fails inside orbax 0.12 after fit (the metric, fit's last
evaluation, still counts); PPO and DDPG are the 0.4.16-era examples and use names 0.4.23 dropped
(``Deployer.process_batch_size``, ``Trainer.params``, the ``train_rng``/``pred_rng`` argument
names), which the old-side worker shims (``alias_v0416_names``) so that they run at all.

Setup of the old side (the scripts' own dependencies at the versions of the compat04 env):
  python -m venv /tmp/redco0423-venv
  /tmp/redco0423-venv/bin/pip install redco==0.4.23 tqdm jax==0.10.2 jaxlib==0.10.2 \\
      flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8 gymnasium==1.4.0 scikit-learn==1.9.1 \\
      scipy==1.17.1 transformers==4.57.6 tokenizers==0.22.2

Run:  .tox/compat04/bin/python bench/compat04_fidelity.py [--seeds 5] [--only ppo,ddpg] [--agreement]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests", "compat04")
RESULT = "BENCH_RESULT "
SCRIPTS = ("lora", "dp", "ppo", "ddpg")  # cheapest first
SEEDS = (42, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
METRIC = {"lora": "validation acc", "dp": "test acc", "ppo": "mean return, episodes 31-40",
          "ddpg": "greedy return"}


# ---- a worker: one script, one seed, one side ---------------------------------------------------
def setup_like_conftest() -> None:
    """What tests/compat04/conftest.py does before a test: 8 simulated devices, offline hubs,
    full-precision matmuls, a fresh working directory; and the test modules importable."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    sys.path.insert(0, TESTS)
    os.chdir(tempfile.mkdtemp(prefix="compat04-fidelity-"))


def import_test(name: str):
    """Import ``tests/compat04/<name>.py`` by path (its helpers are on ``sys.path``)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(TESTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_lora(seed: int, run_index: int) -> dict:
    """test_lora.py's save_init_ckpt + main; the metric is fit's last validation accuracy.

    redco 0.4.23 with orbax 0.12 fails in main's final ``save_ckpt(float_dtype=jnp.float32)``
    (test_lora.py's docstring), after fit: that error is reported, the metric still counts."""
    mod = import_test("test_lora")
    model_dir = mod.make_model_dir(os.path.abspath("hub/tiny-bart"))
    init_ckpt_dir = mod.save_init_ckpt(model_name_or_path=model_dir)
    n_validation = len(mod.get_dataset()[0]["validation"])  # not fit's sanity-check eval
    record: list[dict] = []
    out: dict = {}
    try:
        mod.main(model_name_or_path=model_dir, init_ckpt_dir=init_ckpt_dir, record=record,
                 jax_seed=seed)
    except Exception as error:  # noqa: BLE001 - reported, judged by the driver
        if sum(r["n_examples"] == n_validation for r in record) < mod.N_EPOCHS:
            raise
        out["note"] = f"fit finished; final save_ckpt raised {type(error).__name__}: " \
                      f"{str(error).splitlines()[0][:120]}"
    accs = [r["acc"] for r in record if r["n_examples"] == n_validation]
    return {"metric": accs[-1], "per_epoch": accs, **out}


def run_dp(seed: int, run_index: int) -> dict:
    """test_differential_private_training.py's main; the metric is the last full test accuracy."""
    mod = import_test("test_differential_private_training")
    from _mnist_digits import EVAL_RESULTS, N_TEST
    EVAL_RESULTS.clear()
    mod.main(jax_seed=seed)
    accs = [r["acc"] for r in EVAL_RESULTS if r["n_examples"] == N_TEST]
    return {"metric": accs[-1], "per_epoch": accs}


def run_ppo(seed: int, run_index: int) -> dict:
    """test_ppo.py's main (40 episodes); the metric is the mean return of the last 10."""
    mod = import_test("test_ppo")
    rewards = mod.main(n_episodes=40, jax_seed=seed, on_train=lambda agent, n_examples: None)
    return {"metric": statistics.fmean(rewards[-10:]), "first10": statistics.fmean(rewards[:10]),
            "returns": [int(r) for r in rewards]}


def run_ddpg(seed: int, run_index: int) -> dict:
    """test_ddpg.py's main (10 episodes); the metric is the final actor's greedy return."""
    import random

    import numpy as np
    mod = import_test("test_ddpg")
    random.seed(run_index)  # the replay samples
    np.random.seed(run_index)  # the exploration noise
    agent, rewards = mod.main(jax_seed=seed)
    judged = mod.judge(agent, gamma=0.98)  # main's default gamma
    return {"metric": judged["after"], "initial": judged["before"], "gain": judged["gain"],
            "td_ratio": judged["td_after"] / judged["td_before"],
            "returns": [round(float(r)) for r in rewards]}


def run_ddpg_first_updates(n_updates: int, run_index: int) -> dict:
    """test_ddpg.py's main for one episode with the warm-up shortened to leave ``n_updates``
    updates (replay and noise seeded 0): every param after them, flat, for ``--agreement``."""
    import random

    import jax
    import numpy as np
    mod = import_test("test_ddpg")
    random.seed(0)
    np.random.seed(0)
    agent, _ = mod.main(n_episodes=1, warmup_steps=200 - n_updates)
    leaves = jax.tree.leaves(jax.device_get(agent._trainer.params))
    return {"params": np.concatenate([np.ravel(x) for x in leaves]).tolist()}


RUNNERS: dict[str, Callable[[int, int], dict]] = {
    "lora": run_lora, "dp": run_dp, "ppo": run_ppo, "ddpg": run_ddpg,
    "ddpg_first_updates": run_ddpg_first_updates}


def alias_v0416_names() -> list[str]:
    """test_ppo.py and test_ddpg.py use two names of the 0.4.16-era examples that redco 0.4.23
    no longer has: ``Deployer.process_batch_size`` (0.4.23: ``get_local_global_micro_batch_size``)
    and ``Trainer.params``. Where missing, alias them (the params unreplicated from 0.4.23's pmap
    state, as its Predictor expects them, and unfrozen: DDPG's soft update maps them together with
    its plain-dict target params) and return what was aliased, to be reported."""
    import redco
    aliased = []
    if not hasattr(redco.Deployer, "process_batch_size"):
        redco.Deployer.process_batch_size = redco.Deployer.get_local_global_micro_batch_size
        aliased.append("Deployer.process_batch_size")
    if not hasattr(redco.Trainer, "params"):
        from flax.core import unfreeze
        from flax.jax_utils import unreplicate

        def params(self):
            return unfreeze(unreplicate(self.state.params) if self.mesh is None
                            else self.state.params)
        redco.Trainer.params = property(params)
        aliased.append("Trainer.params")
    if redco.__version__.startswith("0.4."):  # 0.4.23 calls them by 0.4.23's keyword names
        wrap_callbacks_positionally(redco)
        aliased.append("loss_fn(train_rng, ...)/pred_fn(pred_rng, ...) called positionally")
    return aliased


def wrap_callbacks_positionally(redco) -> None:
    """0.4.23 calls ``loss_fn(rng=, state=, params=, batch=, is_training=)`` and
    ``pred_fn(rng=, batch=, params=)``; the 0.4.16-era scripts name the key ``train_rng`` and
    ``pred_rng``. Pass the same values positionally (the order is the same)."""
    trainer_init, predictor_init = redco.Trainer.__init__, redco.Predictor.__init__

    def new_trainer_init(self, *args, loss_fn, **kwargs):
        def positional_loss_fn(rng, state, params, batch, is_training):
            return loss_fn(rng, state, params, batch, is_training)
        trainer_init(self, *args, loss_fn=positional_loss_fn, **kwargs)

    def new_predictor_init(self, *args, pred_fn, **kwargs):
        def positional_pred_fn(rng, batch, params):
            return pred_fn(rng, batch, params)
        predictor_init(self, *args, pred_fn=positional_pred_fn, **kwargs)
    redco.Trainer.__init__, redco.Predictor.__init__ = new_trainer_init, new_predictor_init


def worker(script: str, seed: int, run_index: int) -> None:
    """Run one script with one seed and print its result as one JSON line."""
    setup_like_conftest()
    import redco
    aliased = alias_v0416_names() if script.startswith(("ppo", "ddpg")) else []
    start = time.perf_counter()
    result = RUNNERS[script](seed, run_index)
    if aliased:
        result["note"] = (f"redco {redco.__version__} lacks 0.4.16-era names: "
                          f"{'; '.join(aliased)} (shimmed for this run)")
    result.update(script=script, seed=seed, redco=redco.__version__,
                  seconds=round(time.perf_counter() - start, 1))
    print(RESULT + json.dumps(result), flush=True)


# ---- the driver ---------------------------------------------------------------------------------
def run_worker(python: str, side: str, script: str, seed: int, run_index: int,
               timeout: float) -> dict:
    """One worker subprocess; returns its result, or ``{'error': ...}`` if it failed."""
    cmd = [python, os.path.abspath(__file__), "--worker", "--script", script,
           "--seed", str(seed), "--run_index", str(run_index)]
    # The old side runs in its own environment only: a PYTHONPATH set for this one would put
    # the new redco ahead of 0.4.23 there.
    env = {k: v for k, v in os.environ.items() if not (side == "old" and k == "PYTHONPATH")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)[-400:]}
    return json.loads(lines[-1][len(RESULT):])


def summary(results: list[dict]) -> str:
    """``median [min, max] (n)`` of the runs that finished, plus how many failed."""
    values = [r["metric"] for r in results if "metric" in r]
    failed = len(results) - len(values)
    if not values:
        return f"no run finished ({failed} failed)"
    text = (f"{statistics.median(values):9.3f} [{min(values):9.3f}, {max(values):9.3f}] "
            f"(n={len(values)})")
    return text + (f", {failed} failed" if failed else "")


def report(script: str, runs: dict[str, list[dict]]) -> None:
    """Print one script's per-seed values and its median and spread per side, side by side."""
    print(f"\n== {script}: {METRIC[script]}")
    for side, results in runs.items():
        version = next((r["redco"] for r in results if "redco" in r), "?")
        cells = [f"{r['seed']}:{r['metric']:.3f}" if "metric" in r else f"{r['seed']}:FAILED"
                 for r in results]
        secs = [r["seconds"] for r in results if "seconds" in r]
        print(f"  {side} (redco {version}): {summary(results)}   per seed {' '.join(cells)}"
              + (f"   {statistics.median(secs):.0f} s/run" if secs else ""))
        for r in results:
            if "error" in r or "note" in r:
                print(f"    seed {r['seed']}: {r.get('error') or r.get('note')}")
    values = [[r["metric"] for r in results if "metric" in r] for results in runs.values()]
    if len(values) == 2 and min(map(len, values)) >= 3:
        from scipy.stats import mannwhitneyu
        print(f"  same distribution? two-sided Mann-Whitney U: p = "
              f"{mannwhitneyu(*values).pvalue:.2f} (small p: the sides differ)")


def agreement(pythons: dict[str, str], timeout: float) -> None:
    """Do both sides compute the same DDPG? Params after its first 1, 10 and 100 updates from the
    same seeds, old against new: a difference at float32 rounding that grows with the updates
    says the runs' spread over seeds is chaos amplifying rounding, not a different algorithm."""
    import numpy as np
    print("\n== ddpg: params after the first updates, old vs new (same seeds)")
    for n in (1, 10, 100):
        got = {side: run_worker(python, side, "ddpg_first_updates", n, 0, timeout)
               for side, python in pythons.items()}
        if any("params" not in r for r in got.values()):
            print(f"  {n:3d} updates: a side failed: {got}")
            continue
        old, new = (np.asarray(got[side]["params"]) for side in ("old", "new"))
        print(f"  {n:3d} updates: max |old - new| {np.abs(old - new).max():.2e}, mean "
              f"{np.abs(old - new).mean():.2e} (params up to {np.abs(old).max():.2f})")


def main(argv: list[str] | None = None) -> None:
    """Parse the options; run as a worker, or drive the workers and print the table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old_python", default=os.environ.get(
        "REDCO0423_PYTHON", "/tmp/redco0423-venv/bin/python"),
        help="python of the env holding redco==0.4.23 (or $REDCO0423_PYTHON)")
    parser.add_argument("--seeds", type=int, default=5, help=f"runs per side (seeds {SEEDS})")
    parser.add_argument("--only", default=",".join(SCRIPTS),
                        help=f"comma-separated subset of {','.join(SCRIPTS)}")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--sides", default="old,new", help="old,new (default), old or new")
    parser.add_argument("--agreement", action="store_true",
                        help="instead: DDPG's params after its first 1, 10, 100 updates, old vs new")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--script", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run_index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.script, args.seed, args.run_index)
        return

    pythons = {"old": args.old_python, "new": sys.executable}
    if args.agreement:
        agreement(pythons, args.timeout)
        return
    scripts = [s for s in SCRIPTS if s in args.only.split(",")]
    sides = [side for side in ("old", "new") if side in args.sides.split(",")]
    for script in scripts:
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for i, seed in enumerate(SEEDS[:args.seeds]):
            for side in (sides if i % 2 == 0 else sides[::-1]):  # alternate the order
                result = run_worker(pythons[side], side, script, seed, i, args.timeout)
                runs[side].append({"seed": seed, **result})
                print(f"[{script} {side} seed {seed}] "
                      f"{json.dumps({k: v for k, v in result.items() if k != 'returns'})}",
                      file=sys.stderr, flush=True)
        report(script, runs)
        sys.stdout.flush()


if __name__ == "__main__":
    # as the workers run
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import print_provenance
    print_provenance()
    main()
