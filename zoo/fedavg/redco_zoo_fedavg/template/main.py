"""{{project_name}}: federated averaging (FedAvg, McMahan et al. 2017) with Redco. Run: python main.py

Every client trains the model on its own data through the three functions; the server
(``redco_zoo_fedavg.fedavg``) averages the clients' params, weighted by how many examples each
holds. The model (``init_params``, ``apply_fn``) and the three functions come from
``redco_zoo_fedavg/pipeline.py``, the code ``redco zoo run fedavg`` runs: to change one, copy it
from there into this file in place of its import. Replace the data with yours.
"""
import argparse

import jax
import optax

from redco import Deployer, Trainer
from redco_zoo_fedavg import accuracy, fedavg, load_digits, split_clients
from redco_zoo_fedavg.pipeline import apply_fn, collate_fn, init_params, loss_fn, pred_fn


def main(n_clients: int = 10, n_rounds: int = 50, local_epochs: int = 2, client_fraction: float = 1.0,
         iid: bool = False, learning_rate: float = 0.1, per_device_batch_size: int = 2,
         n_model_shards: int = 1, workdir: str = "./workdir", seed: int = 0) -> float:
    """Train by FedAvg on sklearn digits split over ``n_clients`` (each holding 2 labels unless
    ``iid``); save the server's params as ``workdir/ckpts/server``; return the test accuracy."""
    train, test = load_digits(seed=seed)
    clients = split_clients(train, n_clients, iid, labels_per_client=2, seed=seed)
    deployer = Deployer(jax_seed=seed, n_model_shards=n_model_shards, workdir=workdir)
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=apply_fn, loss_fn=loss_fn,
                      params=jax.device_get(init_params(seed)), optimizer=optax.sgd(learning_rate))
    predictor = trainer.get_default_predictor(pred_fn=pred_fn)

    def on_round(r, params):
        deployer.log_info(f"round {r + 1}/{n_rounds}: test accuracy "
                          f"{accuracy(predictor, params, test):.4f}")

    params = fedavg(trainer, clients, n_rounds, max(1, round(client_fraction * n_clients)),
                    local_epochs, per_device_batch_size, seed=seed, on_round=on_round)
    deployer.save_ckpt("server", {"params": params}, {"rounds": n_rounds})
    return accuracy(predictor, params, test)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n_clients", type=int, default=10)
    parser.add_argument("--n_rounds", type=int, default=50)
    parser.add_argument("--local_epochs", type=int, default=2)
    parser.add_argument("--client_fraction", type=float, default=1.0)
    parser.add_argument("--iid", action="store_true")
    parser.add_argument("--n_model_shards", type=int, default=1)
    parser.add_argument("--workdir", default="./workdir")
    args = parser.parse_args()
    print(f"test accuracy: {main(**vars(args)):.4f}")
