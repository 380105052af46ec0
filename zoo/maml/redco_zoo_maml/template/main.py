"""{{project_name}}: MAML (Finn et al. 2017) on sinusoid regression, written as Redco's three
functions. ``python main.py`` meta-trains and prints the held-out MSE before and after one
adaptation step; ``--n_model_shards 2`` splits the MLP over (2 or more) devices as well.

Tasks are the examples: ``collate_fn`` stacks a meta-batch of them, ``loss_fn`` adapts to each
task's support set and scores its query set, ``pred_fn`` predicts after adapting. The task
sampler, the MLP and the inner step come from ``redco_zoo_maml``. The three functions and
``train``, which calls them, are those of ``redco_zoo_maml/pipeline.py``, the code ``redco zoo
run maml`` runs: to change one, copy it and ``train`` from there into this file in place of
the import of ``train``."""
import argparse

from redco_zoo_maml.pipeline import add_arguments, train

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    train(**vars(parser.parse_args()))
