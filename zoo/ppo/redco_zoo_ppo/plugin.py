"""How ``redco`` finds this package (its ``redco`` entry point): the ``ppo`` pipeline,
imported only when it runs or shows its flags, and the ``ppo`` template."""
import os

from redco.plugins import zoo_hooks

DESCRIPTION = "PPO on a gymnasium env (CartPole-v1 by default); mean return of 20 episodes"

register_zoo_pipelines, register_templates = zoo_hooks(
    "ppo", "redco_zoo_ppo.pipeline:PPOPipeline", DESCRIPTION,
    os.path.dirname(os.path.abspath(__file__)))
