"""{{project_name}}: GRPO with verifiable rewards on a chat model, with Redco.

    python main.py --model my-sft-model --train prompts.jsonl --reward exact_match
    python main.py --model my-sft-model --train prompts.jsonl --reward rewards.py:my_reward \
        --loss_type dapo --clip_high 0.28 --lora_rank 16 --beta 0.04

``--model`` is a local HuggingFace LLaMA, Mistral, Qwen2 or GPT-2 directory whose tokenizer has
a chat template (typically an SFT run's ``workdir/model``); ``--train`` a ``.jsonl`` file of
prompts (``prompt``: messages or a string) with the columns the reward function reads. Each
round samples ``--n_samples`` completions of ``--prompts_per_round`` prompts, scores them,
normalises the rewards within each prompt's group and trains ``--n_updates`` epochs over them.
The three functions and ``train``, which calls them, come from ``redco_zoo_grpo/pipeline.py``,
the code ``redco zoo run grpo`` runs: to change one, copy it and ``train`` from there into this
file in place of the import of ``train``. See ``redco_zoo_grpo/loss.py`` for the loss's pieces and
``redco_zoo_grpo/rollout.py`` for the rounds."""
import argparse

from redco_zoo_grpo.pipeline import GRPORun, add_grpo_arguments, train
from redco_zoo_models import flags
from redco_zoo_models.settings import RunConfig


def parse_args(argv=None) -> RunConfig[GRPORun]:
    """The command line as the run's typed settings (argparse stops here)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags.add_arguments(parser, planner=False)  # --model --train --eval --lora_rank --learning_rate ...
    add_grpo_arguments(parser)  # --reward --n_samples --loss_type --beta --n_updates ...
    return RunConfig.of_flags(parser.parse_args(argv), GRPORun)


if __name__ == "__main__":
    train(parse_args())
