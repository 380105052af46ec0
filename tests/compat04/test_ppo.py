"""Redco 0.4.x script: tanyuqian/redco ``examples/reinforcement_learning/ppo_main.py`` (PPO, one
update per episode; with ``ppo_agent.py``, ``ppo_pipeline.py`` and ``ppo_utils.py``; the newest
stored versions), on gymnasium's CartPole-v1.

Redco calls reproduced, with the original's keywords and use of the results:

- ``Deployer(jax_seed=, verbose=False)``, then ``deployer.gen_rng()`` for each ``model.init``
- for the actor and the critic: ``Trainer(deployer=, collate_fn=, apply_fn=model.apply,
  loss_fn=, params=, optimizer=optax.adam(learning_rate=))`` and ``Predictor(deployer=,
  collate_fn=, pred_fn=partial(pred_fn, model=), output_fn=)`` (``None`` for the actor: one
  array of logits per example; a ``.tolist()`` of the values for the critic)
- ``deployer.process_batch_size(per_device_batch_size=)`` -> ``(_, global_batch_size)``, to
  pick the largest power-of-two per-device batch the data fills
- every env step: ``actor_predictor.predict(examples=, per_device_batch_size=,
  params=actor_trainer.params)``, then ``deployer.gen_rng()`` to sample the action
- every episode: ``critic_predictor.predict(..., params=critic_trainer.params)`` (twice) and the
  actor's logits again, then ``actor_trainer.fit(train_examples=, per_device_batch_size=,
  n_epochs=10)`` and ``critic_trainer.fit(...)`` - the same two Trainers fitted again each
  episode, 10 epochs every time

and Redco calling back ``loss_fn(train_rng, state, params, batch, is_training)`` (through
``state.apply_fn``) and ``pred_fn(pred_rng, batch, params)``. The original's settings
(actor lr 1e-3, critic lr 1e-2, gamma 0.98, GAE lambda 0.95, clip 0.2), 40 episodes.
"""
import time
from collections import namedtuple
from functools import partial

import flax.linen as nn
import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import optax

from redco import Deployer, Predictor, Trainer

Transition = namedtuple('Transition', ['state', 'action', 'next_state', 'reward', 'done'])


# ---- ppo_pipeline ---------------------------------------------------------------------------
class MLP(nn.Module):
    hidden_dim: int = 128
    n_layers: int = 2
    output_dim: int = 1

    @nn.compact
    def __call__(self, x):
        for _ in range(self.n_layers - 1):
            x = nn.relu(nn.Dense(features=self.hidden_dim)(x))
        return nn.Dense(features=self.output_dim)(x)


def collate_fn(examples):
    keys = ['states', 'actions', 'td_targets', 'advantages', 'log_probs0']
    return {key: np.stack([example[key] for example in examples])
            for key in keys if key in examples[0]}


def actor_loss_fn(train_rng, state, params, batch, is_training, epsilon):
    log_probs = nn.log_softmax(state.apply_fn({'params': params}, batch['states']))
    log_probs = jnp.take_along_axis(log_probs, batch['actions'][:, None], axis=-1)[:, 0]
    ratio = jnp.exp(log_probs - batch['log_probs0'])
    clipped = jnp.clip(ratio, 1. - epsilon, 1. + epsilon)
    return -jnp.minimum(ratio * batch['advantages'], clipped * batch['advantages']).mean()


def critic_loss_fn(train_rng, state, params, batch, is_training):
    values = state.apply_fn({'params': params}, batch['states'])[:, 0]
    return jnp.square(values - batch['td_targets']).mean()


def pred_fn(pred_rng, batch, params, model):
    return model.apply({'params': params}, batch['states'])


# ---- ppo_agent ------------------------------------------------------------------------------
class PPOAgent:
    def __init__(self, state_dim, action_dim, actor_lr, critic_lr, gamma, gae_lambda, epsilon,
                 jax_seed=42):
        self._deployer = Deployer(jax_seed=jax_seed, verbose=False)

        self._actor_trainer, self._actor_predictor = self.get_trainer_and_predictor(
            model=MLP(output_dim=action_dim), learning_rate=actor_lr, input_dim=state_dim,
            loss_fn=partial(actor_loss_fn, epsilon=epsilon), output_fn=None)
        self._critic_trainer, self._critic_predictor = self.get_trainer_and_predictor(
            model=MLP(output_dim=1), learning_rate=critic_lr, input_dim=state_dim,
            loss_fn=critic_loss_fn, output_fn=lambda model_output: model_output[:, 0].tolist())

        self._gamma = gamma
        self._gae_lambda = gae_lambda
        self._train_examples = []

    def get_trainer_and_predictor(self, model, input_dim, loss_fn, output_fn, learning_rate):
        params = model.init(self._deployer.gen_rng(), jnp.zeros((1, input_dim)))['params']
        trainer = Trainer(
            deployer=self._deployer,
            collate_fn=collate_fn,
            apply_fn=model.apply,
            loss_fn=loss_fn,
            params=params,
            optimizer=optax.adam(learning_rate=learning_rate))
        predictor = Predictor(
            deployer=self._deployer,
            collate_fn=collate_fn,
            pred_fn=partial(pred_fn, model=model),
            output_fn=output_fn)
        return trainer, predictor

    def get_per_device_batch_size(self, n_examples):
        per_device_batch_size = 1
        while True:
            _, global_batch_size = self._deployer.process_batch_size(
                per_device_batch_size=per_device_batch_size)
            if global_batch_size * 2 > n_examples:
                return per_device_batch_size
            per_device_batch_size *= 2

    def predict_values(self, states):
        return self._critic_predictor.predict(
            examples=[{'states': state} for state in states],
            per_device_batch_size=self.get_per_device_batch_size(n_examples=len(states)),
            params=self._critic_trainer.params)

    def get_actor_logits(self, states):
        return self._actor_predictor.predict(
            examples=[{'states': np.asarray(state)} for state in states],
            per_device_batch_size=self.get_per_device_batch_size(n_examples=len(states)),
            params=self._actor_trainer.params)

    def predict_action(self, state):
        logits = jnp.array(self.get_actor_logits([state])[0])
        return jax.random.categorical(key=self._deployer.gen_rng(), logits=logits).item()

    def update(self, transitions):
        """Generalised advantage estimates and TD targets for one finished episode."""
        v_states = self.predict_values(states=[t.state for t in transitions])
        v_next_states = self.predict_values(states=[t.next_state for t in transitions])
        actions = jnp.array([t.action for t in transitions])
        log_probs0s = nn.log_softmax(jnp.array(
            self.get_actor_logits(states=[t.state for t in transitions])))
        log_probs0s = jnp.take_along_axis(log_probs0s, actions[:, None], axis=-1)[:, 0]

        advantage = 0.
        for t in reversed(range(len(transitions))):
            trans = transitions[t]
            td_target = trans.reward + self._gamma * v_next_states[t] * (1. - trans.done)
            advantage = self._gamma * self._gae_lambda * advantage + (td_target - v_states[t])
            self._train_examples.append({
                'states': trans.state, 'actions': trans.action, 'td_targets': td_target,
                'advantages': advantage, 'log_probs0': log_probs0s[t]})

    def train(self, n_epochs):
        per_device_batch_size = self.get_per_device_batch_size(
            n_examples=len(self._train_examples))
        self._actor_trainer.fit(
            train_examples=self._train_examples,
            per_device_batch_size=per_device_batch_size,
            n_epochs=n_epochs)
        self._critic_trainer.fit(
            train_examples=self._train_examples,
            per_device_batch_size=per_device_batch_size,
            n_epochs=n_epochs)
        self._train_examples = []


# ---- ppo_main -------------------------------------------------------------------------------
def main(env_name='CartPole-v1', n_episodes=40, actor_lr=1e-3, critic_lr=1e-2, gamma=0.98,
         gae_lambda=0.95, epsilon=0.2, jax_seed=42, on_train=None):
    env = gym.make(env_name)
    agent = PPOAgent(
        state_dim=env.observation_space.shape[0], action_dim=env.action_space.n,
        actor_lr=actor_lr, critic_lr=critic_lr, gamma=gamma, gae_lambda=gae_lambda,
        epsilon=epsilon, jax_seed=jax_seed)

    episode_rewards = []
    for episode_idx in range(n_episodes):
        sum_rewards = 0.
        state, info = env.reset(seed=jax_seed + episode_idx)
        transitions = []
        while True:
            action = agent.predict_action(state=state)
            next_state, reward, terminated, truncated, info = env.step(action)
            sum_rewards += reward
            transitions.append(Transition(state=state, action=action, next_state=next_state,
                                          reward=reward, done=int(terminated)))
            state = next_state
            if terminated or truncated:
                episode_rewards.append(sum_rewards)
                agent.update(transitions=transitions)
                n_examples = len(agent._train_examples)
                agent.train(n_epochs=10)
                on_train(agent, n_examples)
                break
    env.close()
    return episode_rewards


def test_ppo_cartpole_improves_over_episodes():
    start = time.perf_counter()
    checks = []

    def on_train(agent, n_examples):
        # 0.4.x fit runs all its n_epochs on every call: each episode's fit adds
        # 10 x (examples // global batch) updates to each trainer.
        _, global_batch_size = agent._deployer.process_batch_size(
            per_device_batch_size=agent.get_per_device_batch_size(n_examples))
        checks.append((agent._actor_trainer.step, agent._critic_trainer.step,
                       10 * (n_examples // global_batch_size)))

    rewards = main(n_episodes=40, on_train=on_train)
    elapsed = time.perf_counter() - start
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    print(f"PPO CartPole-v1: returns {[int(r) for r in rewards]}; mean of the first 10 episodes "
          f"{first:.1f}, of the last 10 {last:.1f} ({sum(rewards):.0f} env steps); {elapsed:.1f} s")

    expected = np.cumsum([n for _, _, n in checks])
    assert [a for a, _, _ in checks] == list(expected), checks
    assert [c for _, c, _ in checks] == list(expected), checks
    # A random policy averages ~22 on CartPole-v1; these initial params, 11-15 over episodes
    # 1-10. Over episodes 31-40, 10 seeds each side (bench/compat04_fidelity.py, BENCHMARKS
    # section 15): redco 0.4.23 66-347 (median 118), this package 91-288 (median 183; 91 with
    # this test's seed 42, where 0.4.23 gave 262: float rounding sends the runs apart). The bar
    # is just under the lowest of 0.4.23's 10 (its median less two standard deviations, -68,
    # would not tell a policy that never learns).
    assert last >= 60 and last >= 2 * first, rewards
