"""PPO (clipped surrogate, GAE) on gymnasium vector envs through the three functions; ``redco zoo run
ppo``. Acting jits ``pred_fn`` on one device: a Predictor call per env step costs more than the step.
Each iteration logs its mean return of the last 20 episodes and its rollout and update seconds
(``metrics.jsonl`` and one log line)."""
import argparse
import base64
import pickle
import time

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import optax

from redco import Deployer, Trainer
from redco_zoo_ppo.plugin import DESCRIPTION


def init_params(rng, obs_dim: int, n_actions: int, hidden: int = 64) -> dict:
    """Separate actor and critic MLPs, orthogonally initialised as in CleanRL (a small actor
    output layer: a near-uniform first policy)."""
    def mlp(rng, sizes, last_scale):
        scales = [np.sqrt(2)] * (len(sizes) - 2) + [last_scale]
        return [{"kernel": jax.nn.initializers.orthogonal(s)(k, (i, o)), "bias": jnp.zeros(o)}
                for k, s, i, o in zip(jax.random.split(rng, len(scales)), scales, sizes, sizes[1:])]
    actor, critic = jax.random.split(rng)
    return {"actor": mlp(actor, [obs_dim, hidden, hidden, n_actions], 0.01),
            "critic": mlp(critic, [obs_dim, hidden, hidden, 1], 1.0)}


def apply_fn(params, obs):
    """``(logits, value)`` for a batch of observations (tanh MLPs)."""
    def mlp(layers, x):
        for layer in layers[:-1]:
            x = jnp.tanh(x @ layer["kernel"] + layer["bias"])
        return x @ layers[-1]["kernel"] + layers[-1]["bias"]
    return mlp(params["actor"], obs), mlp(params["critic"], obs)[..., 0]


def collate_fn(examples: list[dict]) -> dict:
    """Transitions (obs, action, logp, adv, ret) -> one array each."""
    return {k: np.array([e[k] for e in examples], np.int32 if k == "action" else np.float32)
            for k in examples[0]}


def loss_fn(rng, state, params, batch, is_training, clip=0.2, vf_coef=0.5, ent_coef=0.01):
    """Clipped surrogate + ``vf_coef`` x value loss - ``ent_coef`` x entropy (to minimise)."""
    logits, value = state.apply_fn(params, batch["obs"])
    logp_all = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(logp_all, batch["action"][:, None], 1)[:, 0]
    adv = (batch["adv"] - batch["adv"].mean()) / (batch["adv"].std() + 1e-8)
    ratio = jnp.exp(logp - batch["logp"])
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv).mean()
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, -1).mean()
    return -surrogate + vf_coef * 0.5 * jnp.mean((value - batch["ret"]) ** 2) - ent_coef * entropy


def pred_fn(rng, params, batch):
    """A sampled action, its log-probability and the value for each of ``batch["obs"]``."""
    logits, value = apply_fn(params, batch["obs"])
    action = jax.random.categorical(rng, logits)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], 1)[:, 0]
    return {"action": action, "logp": logp, "value": value}


def gae(rewards, values, dones, last_value, gamma=0.98, lam=0.8):
    """Advantages and returns, (T, N) arrays; ``dones[t]``: an episode ended at step t."""
    values, adv, last = np.append(values, last_value[None], 0), np.zeros_like(rewards), 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * values[t + 1] * (1 - dones[t]) - values[t]
        adv[t] = last = delta + gamma * lam * (1 - dones[t]) * last
    return adv, adv + values[:-1]


class Collector:
    """Steps vector envs with ``act`` (jitted ``pred_fn``); ``envs.return_queue``: last 100 returns."""

    def __init__(self, env_id: str, n_envs: int, act, seed: int):
        self.envs = gym.wrappers.vector.RecordEpisodeStatistics(gym.make_vec(
            env_id, n_envs, vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}))
        self.act, self.obs = act, self.envs.reset(seed=seed)[0]

    def rollout(self, params, key, n_steps: int, gamma=0.98, lam=0.8) -> list[dict]:
        """``n_steps`` steps of every env -> transitions (obs, action, logp, adv, ret)."""
        keys, steps = np.asarray(jax.random.split(key, n_steps + 1)), []
        for t in range(n_steps):
            out = jax.device_get(self.act(keys[t], params, {"obs": self.obs}))
            obs, reward, terminated, truncated, info = self.envs.step(out["action"])
            done, cut = terminated | truncated, truncated & ~terminated
            if cut.any():  # cut off by the time limit: bootstrap from the last observation
                final = np.stack([f if c else o for f, c, o in zip(info["final_obs"], cut, obs)])
                value = jax.device_get(self.act(keys[t], params, {"obs": final}))["value"]
                reward = reward + gamma * cut * value
            steps.append(dict(out, obs=self.obs, reward=reward, done=done))
            self.obs = obs
        roll = {k: np.stack([s[k] for s in steps]) for k in steps[0]}  # (T, N, ...)
        last_value = jax.device_get(self.act(keys[-1], params, {"obs": self.obs}))["value"]
        roll["adv"], roll["ret"] = gae(roll.pop("reward"), roll.pop("value"), roll.pop("done"),
                                       last_value, gamma, lam)
        return [dict(zip(roll, row)) for row in zip(*(v.reshape(-1, *v.shape[2:]) for v in roll.values()))]


class Iterations:
    """PPO's loop state for ``trainer.run``: the iterations done and the envs as they stand
    (each sub-env with its rng, the vector env's and the episode statistics' fields, pickled
    into the step checkpoint), so a resumed run steps them on exactly."""

    def __init__(self, collector: Collector):
        self.collector, self.done = collector, 0

    def state_dict(self) -> dict:
        envs = self.collector.envs
        fields = ({k: v for k, v in vars(envs).items() if k != "env"},
                  {k: v for k, v in vars(envs.unwrapped).items() if k != "env_fns"},
                  self.collector.obs)
        return {"iteration": self.done, "envs": base64.b64encode(pickle.dumps(fields)).decode()}

    def load_state_dict(self, state: dict) -> None:
        envs, self.done = self.collector.envs, state["iteration"]
        wrapper, vector, self.collector.obs = pickle.loads(base64.b64decode(state["envs"]))
        vars(envs).update(wrapper)
        vars(envs.unwrapped).update(vector)


def placeholder(envs, n: int) -> list[dict]:
    """``n`` transitions shaped as a rollout's: the trainer's layout is decided on them."""
    obs = np.zeros(envs.single_observation_space.shape, np.float32)
    return [{"obs": obs, "action": 0, "logp": 0.0, "adv": 0.0, "ret": 0.0}] * n


def report(deployer: Deployer, step: int, where: str, returns: list, rollout_s: float,
           update_s: float) -> None:
    """An iteration's mean return of the last 20 episodes and its rollout and update seconds, to
    ``metrics.jsonl`` and as one log line."""
    mean = np.mean(returns[-20:] or [0])
    deployer.log_metrics({"mean_return_20": mean, "rollout_seconds": rollout_s,
                          "update_seconds": update_s}, step)
    shown = f"mean return of the last 20 episodes {mean:.1f}" if returns else "no episode ended yet"
    deployer.log_info(f"{where}: {shown}; rollout {rollout_s:.1f} s, updates {update_s:.1f} s")


def train(env_id="CartPole-v1", total_steps=300_000, n_envs=16, n_steps=64, seed=0,
          n_model_shards=1, workdir="./workdir", lr=1e-3, update_epochs=4, n_minibatches=4,
          gamma=0.98, lam=0.8, verbose=True, save_every_n_steps=None):
    """Train for ``total_steps`` env steps; returns ``(trainer, the last 100 episode returns)``.
    Run in ``trainer.run``: a rerun in ``workdir`` resumes after the newest step checkpoint
    (every ``save_every_n_steps`` updates, on SIGTERM and at the end)."""
    collector = Collector(env_id, n_envs, jax.jit(pred_fn), seed)
    deployer = Deployer(jax_seed=seed, n_model_shards=n_model_shards, workdir=workdir, verbose=verbose)
    n_iters = total_steps // (n_envs * n_steps)
    per_device = n_envs * n_steps // n_minibatches // deployer.dp_size  # rows of a minibatch
    if n_iters < 1 or per_device < 1:
        raise ValueError(f"Too few steps: {total_steps=} makes {n_iters} rollouts of {n_envs}x{n_steps} env "
                         f"steps and minibatches of {per_device} rows per device; raise total_steps or "
                         "lower n_minibatches.")
    schedule = optax.linear_schedule(lr, 0.0, n_iters * update_epochs * n_minibatches)
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(schedule, eps=1e-5))
    params = init_params(jax.random.PRNGKey(seed), collector.envs.single_observation_space.shape[0],
                         collector.envs.single_action_space.n)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optimizer, lr_schedule_fn=schedule)
    trainer.prepare(placeholder(collector.envs, per_device * deployer.dp_size), per_device)
    loop = Iterations(collector)
    with trainer.run(loop=loop, save_every_n_steps=save_every_n_steps) as run:
        while loop.done < n_iters:
            it, where, start = loop.done, f"iteration {loop.done + 1}/{n_iters}", time.perf_counter()
            with run.timed("rollout"):
                params = jax.device_put(jax.device_get(trainer.params), jax.local_devices()[0])
                examples = collector.rollout(params, jax.random.PRNGKey(seed + 1 + it), n_steps, gamma, lam)
            rollout_s, start = time.perf_counter() - start, time.perf_counter()
            trainer.train_scanned(examples, per_device,  # all epochs' updates: one compiled call
                                  range(it * update_epochs, (it + 1) * update_epochs), desc=where)
            report(deployer, trainer.step, where, list(collector.envs.return_queue), rollout_s,
                   time.perf_counter() - start)
            loop.done += 1
            run.step_done()
    collector.envs.close()
    return trainer, list(collector.envs.return_queue)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line: some of ``train``'s parameters as flags."""
    parser.add_argument("--env_id", default="CartPole-v1")
    parser.add_argument("--total_steps", type=int, default=300_000, help="env steps")
    parser.add_argument("--n_envs", type=int, default=16)
    parser.add_argument("--jax_seed", "--seed", dest="seed", type=int, default=0,
                        help="seeds jax and the data (train's seed)")
    parser.add_argument("--n_model_shards", type=int, default=1)
    parser.add_argument("--workdir", default="./workdir")
    parser.add_argument("--save_every_n_steps", type=int, help="a step checkpoint every this "
                        "many updates (also on SIGTERM and at the end); a rerun resumes")


class PPOPipeline:
    description = DESCRIPTION

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_arguments(parser)

    def run(self, args: argparse.Namespace) -> float:
        _, returns = train(**vars(args))
        print(f"mean return of the last 20 episodes: {np.mean(returns[-20:]):.1f}")
        return float(np.mean(returns[-20:]))
