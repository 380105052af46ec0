"""FedAvg (McMahan et al. 2017) through the three functions, and ``redco zoo run fedavg``: clients
train an MLP on their own 8x8 digits; the server averages their params, weighted by data size."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import redco
from redco_zoo_fedavg.plugin import DESCRIPTION


def init_params(seed: int = 0, sizes: tuple = (64, 128, 10)) -> dict:
    """MLP params ``fc1``, ``fc2``, ...: kernels ~ N(0, 1 / fan_in), zero biases."""
    keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes) - 1)
    return {f"fc{i + 1}": {"kernel": jax.random.normal(k, (m, n)) * m ** -0.5, "bias": jnp.zeros(n)}
            for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def apply_fn(params, x):
    """A one-hidden-layer ReLU MLP: pixels (B, 64) -> logits (B, 10)."""
    h = jax.nn.relu(x @ params["fc1"]["kernel"] + params["fc1"]["bias"])
    return h @ params["fc2"]["kernel"] + params["fc2"]["bias"]


def collate_fn(examples: list[dict]) -> dict:
    """``{"x": 64 pixels in 0..16, "y": label}`` examples -> ``x`` (B, 64) in [0, 1], ``y`` (B,)."""
    return {"x": np.stack([e["x"] for e in examples]).astype(np.float32) / 16.,
            "y": np.array([e["y"] for e in examples], np.int32)}


def loss_fn(rng, state, params, batch, is_training):
    """Mean cross-entropy."""
    logits = state.apply_fn(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def pred_fn(rng, params, batch):
    """The predicted class of each example."""
    return jnp.argmax(apply_fn(params, batch["x"]), axis=-1)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[list, list]:
    """scikit-learn's 1,797 8x8 digits, shuffled, as ``(train, test)`` lists of ``{"x", "y"}``."""
    from sklearn.datasets import load_digits as sklearn_digits
    x, y = sklearn_digits(return_X_y=True)
    examples = [{"x": x[i], "y": int(y[i])} for i in np.random.default_rng(seed).permutation(len(y))]
    n = int(len(examples) * test_fraction)
    return examples[n:], examples[:n]


def split_clients(examples: list, n_clients: int, iid: bool, labels_per_client: int = 2,
                  seed: int = 0) -> list[list]:
    """IID: a random equal split. Non-IID (pathological): shards of ``labels_per_client`` labels."""
    rng = np.random.default_rng(seed)
    if iid:
        return [[examples[i] for i in part]
                for part in np.array_split(rng.permutation(len(examples)), n_clients)]
    labels = np.array([e["y"] for e in examples])
    n_parts = -(-n_clients * labels_per_client // len(set(labels)))  # shards of each label
    parts = [np.array_split(rng.permutation(np.flatnonzero(labels == y)), n_parts) for y in np.unique(labels)]
    # part p of every label, labels rotated by p; client c takes shards c, c + n_clients, ...
    shards = [parts[(i + p) % len(parts)][p] for p in range(n_parts) for i in range(len(parts))]
    return [[examples[i] for j in range(labels_per_client) for i in shards[c + j * n_clients]]
            for c in range(n_clients)]


def train_locally(trainer: redco.Trainer, params, examples: list, n_epochs: int,
                  per_device_batch_size: int, first_epoch: int) -> dict:
    """From ``params`` (on the host) and a fresh optimizer state, train ``n_epochs`` on ``examples``
    (epoch ``first_epoch + e`` seeds the order) with ``trainer``'s compiled step; return params."""
    trainer.set_train_state(params=params)  # a fresh optimizer state too
    for e in range(n_epochs):
        trainer.train_epoch(examples, per_device_batch_size, epoch=first_epoch + e)
    return jax.device_get(trainer.params)


class ServerRounds:
    """FedAvg's loop state for ``trainer.run``: the rounds done and the client sampler's rng (the
    server's params are the trainer's, set after each round, so the step checkpoint holds them)."""

    def __init__(self, seed: int):
        self.done, self.rng = 0, np.random.default_rng(seed)

    def state_dict(self) -> dict:
        return {"round": self.done, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.done, self.rng.bit_generator.state = state["round"], state["rng"]


def fedavg(trainer: redco.Trainer, clients: list, n_rounds: int, clients_per_round: int,
           local_epochs: int, per_device_batch_size: int, seed: int = 0, on_round=lambda r, p: None,
           **run_options):
    """The server: each round, train ``clients_per_round`` sampled clients from its params and
    average theirs, weighted by their numbers of examples; ``on_round(round, params)`` after each.
    Run in ``trainer.run(**run_options)``: a rerun resumes after the newest step checkpoint."""
    trainer.prepare(clients[0], per_device_batch_size)  # the layout, before the run
    loop = ServerRounds(seed)
    with trainer.run(loop=loop, **run_options) as run:
        server = jax.device_get(trainer.params)
        while loop.done < n_rounds:
            r = loop.done
            chosen = sorted(int(c) for c in loop.rng.choice(len(clients), clients_per_round, replace=False))
            local = [train_locally(trainer, server, clients[c], local_epochs, per_device_batch_size,
                                   first_epoch=(r * len(clients) + c) * local_epochs) for c in chosen]
            sizes = [len(clients[c]) for c in chosen]
            server = jax.tree.map(lambda *ps: np.average(ps, axis=0, weights=sizes).astype(ps[0].dtype),
                                  *local)
            trainer.set_train_state(params=server)  # what the step checkpoint keeps
            loop.done += 1
            on_round(r, server)
            run.step_done()
    return server


def accuracy(predictor: redco.Predictor, params, examples: list) -> float:
    preds = predictor.predict(examples, per_device_batch_size=16, params=params)
    return float(np.mean(np.array(preds) == np.array([e["y"] for e in examples])))


class FedAvgPipeline:
    description = DESCRIPTION

    def add_arguments(self, parser) -> None:
        for name, value, doc in [
                ("n_clients", 10, ""), ("n_rounds", 50, ""), ("local_epochs", 2, "E"),
                ("client_fraction", 1.0, "C: the fraction of clients sampled each round"),
                ("learning_rate", 0.1, "of the clients' SGD"), ("per_device_batch_size", 2, ""),
                ("labels_per_client", 2, "non-IID: how many labels each client holds"),
                ("n_model_shards", 1, ""), ("workdir", "./workdir", "")]:
            parser.add_argument(f"--{name}", type=type(value), default=value, help=f"{doc} (default {value})")
        parser.add_argument("--jax_seed", "--seed", dest="seed", type=int, default=0,
                            help="seeds jax and the data (default 0)")
        parser.add_argument("--iid", action="store_true", help="split the data IID instead")
        parser.add_argument("--save_every_n_steps", type=int, help="a step checkpoint after the "
                            "round that reaches every this many updates (also on SIGTERM and at "
                            "the end); a rerun resumes")

    def run(self, args) -> dict:
        """FedAvg, and its two baselines: the same MLP trained centrally on the union of the clients'
        data (as many examples seen as FedAvg) and on each client's data alone (as many epochs as
        FedAvg gives it); print and return test accuracies ``fedavg``, ``centralised``, ``alone``."""
        train, test = load_digits(seed=args.seed)
        clients = split_clients(train, args.n_clients, args.iid, args.labels_per_client, args.seed)
        deployer = redco.Deployer(jax_seed=args.seed, n_model_shards=args.n_model_shards,
                                  workdir=args.workdir)
        params = jax.device_get(init_params(args.seed))
        trainer = redco.Trainer(deployer, collate_fn, apply_fn, loss_fn, params,
                                optax.sgd(args.learning_rate))  # fc1 column-, fc2 row-parallel
        predictor = trainer.get_default_predictor(pred_fn)

        def on_round(r, server):
            acc = accuracy(predictor, server, test)
            deployer.log_metrics({"round": r + 1, "round/test_accuracy": acc}, trainer.step)
            deployer.log_info(f"round {r + 1}/{args.n_rounds}: test accuracy {acc:.4f}")

        per_round = max(1, round(args.client_fraction * args.n_clients))
        server = fedavg(trainer, clients, args.n_rounds, per_round, args.local_epochs,
                        args.per_device_batch_size, args.seed, on_round,
                        save_every_n_steps=args.save_every_n_steps)
        n_epochs = args.n_rounds * args.local_epochs  # of each sampled client's data

        def from_scratch(examples, epochs, first_epoch):  # first_epoch: epoch seeds after FedAvg's
            return accuracy(predictor, train_locally(trainer, params, examples, epochs,
                                                     args.per_device_batch_size, first_epoch), test)

        result = {"fedavg": accuracy(predictor, server, test),
                  "centralised": from_scratch(train, max(1, n_epochs * per_round // args.n_clients),
                                              n_epochs * args.n_clients),
                  "alone": [from_scratch(client, n_epochs, n_epochs * (args.n_clients + 1 + c))
                            for c, client in enumerate(clients)]}
        deployer.log_info("test accuracy: FedAvg {:.4f}, centralised {:.4f}, best client alone {:.4f}".format(
            result["fedavg"], result["centralised"], max(result["alone"])))
        return result
