"""A bare ``python -m fedhpc.launch --algo X`` runs on the embedded data, quickly, and learns
(issue 40, section 0; fedhpc/config/auto.py).

Before: 8 of the 27 methods refused a bare run (the FedAlign family the digits cnn, the one-shot
methods the missing server set), Mix2FLD took four minutes a round (K_s = 3,200 server steps on
200 seeds) and FedAvg reached 58.8% in 20 rounds (lr 0.05, one epoch; FD ended at chance). Here:
what a bare run resolves to, every method running two bare rounds above chance, and the bound a
full default Mix2FLD run keeps. The whole file takes well under a minute on one core.
"""

from __future__ import annotations

import math
import os

import pytest

import fedhpc
from fedhpc.config import parse_args
from fedhpc.registry import ALGORITHMS, load_algorithm_modules

load_algorithm_modules()
METHODS = ALGORITHMS.names()
#: the one-shot methods' single round trains the server 100 Adam epochs (the authors'); the test cuts
#: that alone, every other setting is the bare run's
QUICK = {"xormixfl": {"server_epochs": 5}, "mixfl": {"server_epochs": 5}, "standalone": {"server_epochs": 5}}


def reported_accuracy(algo: str, final) -> float:
    """The accuracy a method reports: its global model's on the test set, or, for methods whose
    clients keep models of their own, the better of those models' mean and the reference device's."""
    keys = ("test_accuracy", "local_test_accuracy_mean", "reference_device_accuracy")
    if not ALGORITHMS.get(algo).has_global_model:
        keys = keys[1:]
    return max(final[k] for k in keys if k in final)


def test_the_registry_holds_the_methods_this_file_was_written_for():
    assert len(METHODS) == 27, "a method was added or removed: check that it runs bare (this file runs them all)"


@pytest.mark.parametrize("algo", METHODS)
def test_every_method_runs_bare_on_digits(algo):
    """Two rounds of every method as a bare run makes them (no refusal, no NaN). Two rounds do not
    lift the digits cnn off its first plateau (most methods are at 0.1-0.2 then; they end at
    0.55-0.97 after the default 20 rounds: the table in the change's report); the ResNet and
    one-shot methods are already well above chance (0.26-0.58)."""
    r = fedhpc.run(algo=algo, rounds=2, threads=1, quiet=True, tensorboard=False, **QUICK.get(algo, {}))
    assert [rec["round"] for rec in r.rounds] == [1, 2]
    assert all(math.isfinite(rec["train_loss"]) for rec in r.rounds)
    acc = reported_accuracy(algo, r.final)
    assert 0 <= acc <= 1
    if algo in ("fedalign", "moon", "stochdepth", "gradaug", "xormixfl", "mixfl"):
        assert acc > 0.2, f"{algo}: {acc:.3f} after two bare rounds (chance 0.1): {r.final}"


def test_a_bare_fedavg_run_learns_within_a_few_rounds():
    """RunConfig's lr 0.05 and one epoch left FedAvg at 14% after five rounds (58.8% after 20);
    digits' own settings (lr 0.1, two epochs) reach 63% in five and 93% in 20."""
    r = fedhpc.run(algo="fedavg", rounds=5, threads=1, quiet=True, tensorboard=False)
    assert r.final["test_accuracy"] > 0.5, r.final


@pytest.mark.parametrize("algo", ["fedalign", "stochdepth", "xormixfl", "mix2fld"])
def test_bare_runs_on_mnist5k(algo):
    """mnist5k (28x28): the FedAlign family's resnet_mnist, the one-shot server set and Mix2FLD's
    scaled K_s there too (one round; the one-shot server's epochs cut as above)."""
    r = fedhpc.run(algo=algo, dataset="mnist5k", rounds=1, threads=1, quiet=True, tensorboard=False,
                   **QUICK.get(algo, {}))
    assert math.isfinite(r.rounds[0]["train_loss"]) and 0 <= reported_accuracy(algo, r.final) <= 1


def test_what_a_bare_run_resolves_to_on_digits():
    def bare(algo, *extra):
        return parse_args(["--algo", algo, "--no-out", *extra])

    cfg, _, _ = bare("fedavg")
    assert (cfg.model, cfg.partition, cfg.lr, cfg.local_epochs) == ("auto", "auto", 0.1, 2)
    assert cfg.auto_resolved == ("lr 0.1 (the digits default)", "local_epochs 2 (the digits default)")
    # given values are kept, from a flag or a file
    cfg, _, _ = bare("fedavg", "--lr", "0.05")
    assert (cfg.lr, cfg.local_epochs) == (0.05, 2)
    # the FedAlign family gets digits' residual network, MOON its projection head
    for algo in ("fedalign", "moon", "stochdepth", "gradaug"):
        cfg, _, _ = bare(algo)
        assert cfg.model == "resnet_digits", algo
        assert cfg.model_options == ({"projection_dim": 256} if algo == "moon" else {}), algo
    cfg, _, _ = bare("mixup")
    assert cfg.model == "auto"  # mixup needs no residual network: the digits cnn
    cfg, _, _ = bare("moon", "--model-opt", "projection_dim=8")
    assert cfg.model_options == {"projection_dim": 8}
    cfg, _, _ = bare("fedalign", "--model", "cnn")  # a model named is the model run (and refused by the method)
    assert cfg.model == "cnn"
    # the one-shot methods get a server base set, unless the run gives one
    for algo in ("xormixfl", "mixfl", "standalone"):
        _, _, data = bare(algo)
        assert (data.server_per_label, data.server_deficient, data.server_deficient_count) == (40, "0", 2), algo
    # ... and one round, where the run gives none: their server trains once, in the first round
    for algo in ("xormixfl", "mixfl", "standalone"):
        cfg, _, _ = bare(algo)
        assert cfg.rounds == 1 and "rounds 1 (one-shot: the server trains once, in the first round)" in \
            cfg.auto_resolved, algo
    assert bare("xormixfl", "--rounds", "3")[0].rounds == 3
    assert bare("fedavg")[0].rounds == bare("fd")[0].rounds == 20  # RunConfig's, for the others
    _, _, data = bare("standalone", "--data-opt", "server_per_label=7")
    assert (data.server_per_label, data.server_deficient, data.server_deficient_count) == (7, "", 0)
    _, _, data = bare("fedavg")
    assert data.server_per_label == 0  # nobody else gets a server set
    # mnist5k sets no run settings of its own: RunConfig's
    cfg, _, _ = bare("fedavg", "--dataset", "mnist5k")
    assert (cfg.lr, cfg.local_epochs, cfg.auto_resolved) == (0.05, 1, ())
    cfg, _, _ = bare("stochdepth", "--dataset", "mnist5k")
    assert cfg.model == "resnet_mnist"


def test_server_steps_are_scaled_to_the_server_set_and_launch_files_keep_the_papers():
    """K_s is FLD.AUTO_SERVER_PASSES passes over the server's samples at --server-batch: N_S seeds
    per device for FLD / MixFLD, N_I inversely mixed samples for Mix2FLD; a given K_s is kept."""
    from fedhpc.algorithms.distillation.fld import FLD

    passes = FLD.AUTO_SERVER_PASSES
    for algo, per_device in (("fld", 10), ("mixfld", 10), ("mix2fld", 10)):
        _, opts, _ = parse_args(["--algo", algo, "--no-out"])
        assert opts.server_steps == math.ceil(passes * 20 * per_device / 32), algo
    _, opts, _ = parse_args(["--algo", "mix2fld", "--no-out", "--inverse-per-device", "20", "--num-clients", "10"])
    assert opts.server_steps == math.ceil(passes * 200 / 32)
    _, opts, _ = parse_args(["--algo", "fld", "--no-out", "--seeds-per-device", "1", "--num-clients", "4",
                               "--clients-per-round", "4"])
    assert opts.server_steps == passes  # 4 seeds: one batch of 4 per pass
    _, opts, _ = parse_args(["--algo", "mix2fld", "--no-out", "--server-steps", "7"])
    assert opts.server_steps == 7
    mnist_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launch", "mix2fld_mnist.yaml")
    _, opts, _ = parse_args(["--config", mnist_file, "--data-dir", "/nowhere"])
    assert opts.server_steps == 3200  # the paper's K_s, written in the file


def test_a_full_default_mix2fld_run_is_bounded_by_its_resolved_settings(monkeypatch):
    """Every round of the bare default run (20 rounds) converts on its 200 inversely mixed samples in
    exactly the resolved K_s steps (50, not the paper's 3,200): one round, the server trainer counted."""
    from fedhpc.engine import Engine
    from fedhpc.server.trainer import ServerTrainer
    from fedhpc.world import World

    cfg, opts, data = parse_args(["--algo", "mix2fld", "--no-out", "--threads", "1", "--quiet"])
    assert (cfg.rounds, opts.server_steps, opts.server_batch) == (20, 50, 32)
    fits = []
    fit = ServerTrainer.fit

    def counted(self, x, y, tcfg, **kw):
        fits.append((len(x), tcfg.steps, tcfg.batch_size))
        return fit(self, x, y, tcfg, **kw)

    monkeypatch.setattr(ServerTrainer, "fit", counted)
    eng = Engine(cfg, opts, data, World(threads=1))
    try:
        eng.run_round(0)
    finally:
        eng.client_state.close()
        eng.data.close()
    assert fits == [(200, 50, 32)]
    # the whole default run: 20 x 50 steps of 32 samples, 32,000 samples through the server's model
    # (the paper's K_s made it 2,048,000)
    assert cfg.rounds * opts.server_steps * opts.server_batch == 32_000


def test_the_start_of_a_run_says_what_auto_resolved_to(capsys):
    fedhpc.run(algo="stochdepth", rounds=1, threads=1, tensorboard=False, num_clients=4, clients_per_round=2)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("auto: ")]
    assert lines == ["auto: partition iid; lr 0.1 (the digits default); local_epochs 2 (the digits default); "
                     "model resnet_digits (stochdepth needs a residual network instead of the digits default cnn)"]


def test_launch_files_leave_nothing_to_the_bare_defaults():
    """The papers' settings stay in the launch files: none leaves a setting to what a bare run
    resolves (digits' lr and epochs, a method's model, server set or K_s), so every file runs as
    before, and FedAlign's files train the rescaled loss they always named."""
    import glob

    files = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launch", "*.yaml")))
    assert len(files) > 50
    for path in files:
        cfg, opts, _ = parse_args(["--config", path, "--data-dir", "/nowhere"])
        assert cfg.auto_resolved == (), (path, cfg.auto_resolved)
        if cfg.algo == "fedalign":
            assert opts.lip_rescale, path
