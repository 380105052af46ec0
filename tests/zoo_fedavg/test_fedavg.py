"""redco-zoo-fedavg: FedAvg learns pathological non-IID digits, and the pipeline and the template
are found through entry points (the template's project: tests/templates)."""
import argparse

from redco.cli import main as redco_main
from redco_zoo_fedavg.pipeline import FedAvgPipeline, load_digits, split_clients


def test_pathological_split_gives_each_client_two_labels():
    train, test = load_digits(seed=0)
    assert (len(train), len(test)) == (1438, 359)
    clients = split_clients(train, n_clients=10, iid=False, labels_per_client=2, seed=0)
    label_sets = [frozenset(e["y"] for e in client) for client in clients]
    assert all(len(labels) == 2 for labels in label_sets)
    assert len(set(label_sets)) == 10  # no two clients hold the same pair
    assert sorted(id(e) for c in clients for e in c) == sorted(id(e) for e in train)
    iid = split_clients(train, n_clients=10, iid=True, seed=0)
    assert all(len({e["y"] for e in client}) == 10 for client in iid)


def test_fedavg_learns_non_iid_digits_and_beats_a_client_alone(workdir):
    """10 clients holding 2 labels each, all sampled each round, 2 local epochs of SGD, 50
    rounds, the MLP split over 2 model shards (dp 4 x mp 2)."""
    parser = argparse.ArgumentParser()
    pipeline = FedAvgPipeline()
    pipeline.add_arguments(parser)
    args = parser.parse_args(["--n_model_shards", "2", "--per_device_batch_size", "4",
                              "--workdir", workdir])
    result = pipeline.run(args)
    print(f"test accuracy: FedAvg {result['fedavg']:.4f}, client 0 alone {result['alone']:.4f}")
    assert result["fedavg"] >= 0.85
    assert result["fedavg"] >= 3 * result["alone"]


def test_zoo_list_and_new_list_show_fedavg(capsys):
    redco_main(["zoo", "list"])
    assert any(line.split()[0] == "fedavg" for line in capsys.readouterr().out.splitlines())
    redco_main(["new", "--list"])
    assert "fedavg" in capsys.readouterr().out
