"""Batched clients (fedhpc.batched) with dropout and BatchNorm, and the methods that opted in after the
first five: every client's weights, running statistics and training loss within float rounding of the
sequential path (clients of unequal sizes, 2 epochs, momentum + weight decay), the same model on 1 and
2 ranks.

Dropout masks are each client's own draws (its generator state after its download, advanced by its
own steps only), so the tolerance is the one of the models without dropout: a wrong mask would move
a weight by ~lr, not by 1e-7. The models are the well-conditioned ones (the digits CNN, a narrow
ResNet): BatchNorm over a few 1x1 feature maps (MobileNet on 8x8 digits) is ill-conditioned, and
native and batched float32 statistics both sit 1e-4 to 1e-3 from a float64 forward there.
"""

from __future__ import annotations

import os

import pytest
import torch

from fedhpc.algorithms.base import derive_seed, seed_torch
from fedhpc.batched import check_batchable, device_generator, train_in_groups
from fedhpc.errors import ConfigError
from fedhpc.round import ClientContext
from test_batched import (ALGO_OPTIONS, BASE, TOL, assert_own_models_equal, assert_rounds_equal, assert_same_clients,
                          batched_clients, make_engine, round_info, rounds_envelope, run_rounds, sequential_clients,
                          steps_per_epoch)

CNN = {"width": 4, "hidden": 16}
DROPOUT = dict(model="cnn", model_options={**CNN, "dropout": 0.3})
BATCHNORM = dict(model="cnn", model_options={**CNN, "norm": "batch"})
BOTH = dict(model="cnn", model_options={**CNN, "norm": "batch", "dropout": 0.3})


def same_as_sequential(algo, options, k=4, **kw):
    start = make_engine(algo, options, **kw).global_state.clone()
    seq = sequential_clients(make_engine(algo, options, **kw), 0)
    bat = batched_clients(make_engine(algo, options, **kw), 0, k)
    assert_same_clients(seq, bat, start, rerun=lambda s: sequential_clients(make_engine(algo, options, perturb=s, **kw), 0))
    return seq, bat


def test_the_workload_has_unequal_clients():
    """What the equality tests below rely on (as in test_batched.py): steps differ, last batches are short."""
    eng = make_engine(**BOTH)
    sampled = round_info(eng, 0).my_clients
    assert len(set(steps_per_epoch(eng, sampled))) > 1
    assert any(int(eng.data.client(c).num_train) % BASE["batch_size"] for c in sampled)


@pytest.mark.parametrize("model", ["dropout", "batchnorm"])
def test_fedavg_with_dropout_or_batchnorm_equals_sequential(model):
    same_as_sequential("fedavg", {}, **{"dropout": DROPOUT, "batchnorm": BATCHNORM}[model])


@pytest.mark.parametrize("algo", list(ALGO_OPTIONS))
def test_the_first_five_with_dropout_and_batchnorm_equal_sequential(algo):
    """FedAvg, FedProx, NaiveMix, FedMix (its double backward through both layers) and LocalMix."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FedMix's advice against BatchNorm (it can diverge over many rounds)
        same_as_sequential(algo, ALGO_OPTIONS[algo], **BOTH)


def test_batchnorm_running_statistics_are_each_clients_own():
    """The running statistics (flat state past the parameters) moved, client by client, as in the
    sequential path: a shared or unmasked statistic would differ by far more than rounding."""
    seq, bat = same_as_sequential("fedavg", {}, **BATCHNORM)
    eng = make_engine(**BATCHNORM)
    p = eng.flat.num_params
    assert eng.flat.numel > p
    for cid in seq:
        assert float((seq[cid][0][p:] - eng.global_state[p:]).abs().max()) > 1e-3  # they moved
        assert float((seq[cid][0][p:] - bat[cid][0][p:]).abs().max()) <= TOL


def test_group_sizes_grad_clip_and_nesterov_with_dropout_and_batchnorm():
    for k in (1, 5, 10):
        same_as_sequential("fedprox", {"mu": 0.1}, k=k, grad_clip=0.5, **BOTH)
    same_as_sequential("fedavg", {}, nesterov=True, **BOTH)


def test_residual_network_with_batchnorm_equals_sequential():
    """resnet_digits: BatchNorm after every convolution, residual additions, a projection shortcut."""
    same_as_sequential("fedavg", {}, model="resnet_digits", model_options={"width": 4}, lr=0.01, momentum=0.5)


def test_channel_dropout_equals_sequential():
    """pMixFed's MNIST CNN: Dropout2d (one mask per feature map) and Dropout, p = 0.5."""
    same_as_sequential("fedavg", {}, model="pmixfed_cnn_mnist", model_options={"channels": [4, 8], "hidden": 16},
                       dataset="synthetic", data_options={"shape": "1x28x28", "train_samples": 480,
                                                          "test_samples": 50},
                       lr=0.01, momentum=0.5)


def test_generator_left_where_each_clients_sequential_training_leaves_it():
    """After the group trains, torch's generator is at each client's own post-training state while
    the client is handed back (its upload would draw what it draws sequentially)."""
    eng = make_engine(**DROPOUT)
    rnd = round_info(eng, 0)
    gen = device_generator(eng.world.device)
    want = {}
    for cid in rnd.my_clients:
        seed_torch(derive_seed(eng.cfg.seed, "client", 0, cid), eng.world.device)
        eng.flat.load_(eng.global_state)
        ctx = ClientContext(eng.algo, cid, eng.data.client(cid).training_on(eng.world.device), rnd)
        eng.algo.download(ctx)
        eng.algo.local_update(eng.model, ctx)
        want[cid] = gen.get_state()
    other = make_engine(**DROPOUT)
    rnd = round_info(other, 0)
    check_batchable(other.algo, other.model, other.cfg)
    got = {cid: gen.get_state() for cid, _, _, _ in train_in_groups(other, rnd, rnd.my_clients, 4)}
    assert list(got) == list(want)
    for cid in want:
        assert torch.equal(got[cid], want[cid]), cid
    # and the draws were real: a client's state moved away from its seed
    seed_torch(derive_seed(eng.cfg.seed, "client", 0, rnd.my_clients[0]), eng.world.device)
    assert not torch.equal(gen.get_state(), want[rnd.my_clients[0]])


def test_a_forward_of_other_rows_must_say_which_are_real():
    """A hook calling group.forward on a batch of another row count (a mean sample per client, say)
    through a model with dropout must pass each client's real rows; with them it runs."""
    from fedhpc.batched import ClientGroup
    from fedhpc.algorithms.fedavg import FedAvg

    eng = make_engine(**DROPOUT)
    calls = []

    class TwoForwards(FedAvg):
        batchable = True

        def batched_loss(self, group: ClientGroup, x, y, weight):
            if not calls:
                with pytest.raises(RuntimeError, match="real rows"):
                    group.forward(x[:, :1])
            calls.append(group.forward(x[:, :1], real=[1 if a else 0 for a in group.active]))
            return super().batched_loss(group, x, y, weight)

    eng.algo.__class__ = TwoForwards
    batched_clients(eng, 0, 4)
    assert calls


# ----------------------------------------------------------------------------- methods opted in after the first five

#: the methods that opted in with issue 41, and options that make them draw what they draw
MORE = {
    "mixup": {"gamma": 0.4},
    "fedper": {},
    "lg_fedavg": {},
    "fedsim": {},
    "pmixfed": {},
    "pmixfed_dynamic": {"mu": 0.3},
    # one raw partner per real row from the pool of the other clients' samples, lambda ~ Beta, the prox term
    "globalmix": {"mix_alpha": 0.5, "prox_mu": 0.1},
}


@pytest.mark.parametrize("model", ["mlp", "dropout+batchnorm"])
@pytest.mark.parametrize("algo", list(MORE))
def test_more_methods_clients_equal_sequential(algo, model):
    """Round 0 client by client (the personal methods' clients start from the global model then)."""
    same_as_sequential(algo, MORE[algo], **({} if model == "mlp" else BOTH))


@pytest.mark.parametrize("options", [{"select": "batch", "lam": 0.3}, {"raw_per_client": 3, "lam": 0.2}],
                         ids=["one_partner_a_batch", "a_few_shared_samples"])
def test_globalmix_variants_equal_sequential(options):
    """One raw partner for the whole batch (a row broadcast over the client's rows), a fixed lambda, and a
    pool of 3 shared samples a client (partners drawn from fewer rows than a batch has), in groups of 5 + 1."""
    same_as_sequential("globalmix", options, k=5, **BOTH)


def test_globalmix_partners_of_stored_uint8_pixels_equal_sequential():
    """MNIST's pool holds uint8 pixels: a partner must pass the dataset's transform (to [0, 1]) as in
    ``loss`` (digits are stored as floats, where the transform changes nothing)."""
    same_as_sequential("globalmix", {"lam": 0.3}, dataset="mnist5k", num_clients=60, local_epochs=1)


def test_globalmix_client_without_partners_trains_on_plain_ce_in_its_group():
    """A client whose pool holds no other client's sample (only itself shares) takes plain CE in
    ``loss``; in a group it mixes with its own rows, the same within rounding."""
    def without_partners_for(eng, cid):
        download = eng.algo.download

        def patched(ctx):
            download(ctx)
            if ctx.cid == cid:
                ctx.extra["partners"] = ctx.extra["partners"][:0]
        eng.algo.download = patched
        return eng

    opts, kw = {"mix_alpha": 0.5}, BOTH
    cid = round_info(make_engine("globalmix", opts, **kw), 0).my_clients[1]
    start = make_engine("globalmix", opts, **kw).global_state.clone()
    seq = sequential_clients(without_partners_for(make_engine("globalmix", opts, **kw), cid), 0)
    bat = batched_clients(without_partners_for(make_engine("globalmix", opts, **kw), cid), 0, 4)
    assert_same_clients(seq, bat, start)


def test_mixup_without_mixing_and_in_groups_that_do_not_divide():
    same_as_sequential("mixup", {"gamma": 0.0}, **BOTH)
    for k in (1, 5):
        same_as_sequential("mixup", {"gamma": 0.4}, k=k, **BOTH)


@pytest.mark.parametrize("algo", ["fedper", "lg_fedavg", "fedsim", "pmixfed", "pmixfed_dynamic"])
def test_personal_methods_over_rounds_equal_sequential(algo):
    """Three rounds through Engine.run_round: from round 1 on, clients start from their own personal
    layers (FedPer, LG-FedAvg, FedSim) or their own mix of global and local model (pMixFed), which
    their downloads load before the batched steps; the global model, every client's own model in
    the client-state store and the round losses match the sequential run.

    At lr 0.01, momentum 0.5: at the file's lr 0.05, momentum 0.9 a client's personal layers carried
    from round to round amplify rounding, in the sequential path alone (two sequential runs started
    1e-7 apart end pMixFed's round 3 with own models 6e-2 apart, LG-FedAvg's 4e-2)."""
    kw = dict(BOTH, lr=0.01, momentum=0.5)
    seq, m_seq = run_rounds(1, algo, MORE[algo], rounds=3, **kw)
    bat, m_bat = run_rounds(4, algo, MORE[algo], rounds=3, **kw)
    env = rounds_envelope(seq, algo, MORE[algo], **kw)  # another CPU's rounding: see assert_close_or_discrete
    assert_rounds_equal(seq, bat, m_seq, m_bat, env)
    assert assert_own_models_equal(seq, bat, envelope=env) >= 6  # most clients trained, some twice


def test_a_subclass_of_per_fedavg_changing_its_meta_step_is_refused():
    """Per-FedAvg's batched update mirrors its meta-step (tests/test_batched_personal.py): a subclass with
    another meta-gradient or inner step would inherit a batched path that no longer matches it."""
    from fedhpc.algorithms.personal.per_fedavg import PerFedAvg

    class DampedMetaGradient(PerFedAvg):
        def meta_gradient(self, model, batches, ctx):
            loss, g = super().meta_gradient(model, batches, ctx)
            return loss, [0.5 * gi for gi in g]

    class NesterovInnerStep(PerFedAvg):
        def sgd_step(self, model, grads, lr):
            super().sgd_step(model, grads, 2 * lr)

    for cls, hook in ((DampedMetaGradient, "meta_gradient"), (NesterovInnerStep, "sgd_step")):
        eng = make_engine("per_fedavg")
        check_batchable(eng.algo, eng.model, eng.cfg)
        eng.algo.__class__ = cls
        with pytest.raises(ConfigError, match=f"{cls.__name__}.{hook} overrides"):
            check_batchable(eng.algo, eng.model, eng.cfg)


def test_a_subclass_of_a_phased_method_changing_a_phase_is_refused():
    """An opt-in is its class's own: a subclass overriding FedAlt's personal phase or Ditto's personal
    step (which their batched updates do not call) must declare ``batchable`` itself."""
    from fedhpc.algorithms.personal.ditto import Ditto
    from fedhpc.algorithms.personal.fedalt import FedAlt

    class LongerPersonalPhase(FedAlt):
        def personal_phase(self, model, ctx, epochs, first_epoch=0):
            super().personal_phase(model, ctx, epochs + 1, first_epoch)

    class ClippedPersonalStep(Ditto):
        def personal_step(self, x, y, opt, anchor):
            return super().personal_step(x, y, opt, anchor).clamp(max=10)

    for algo, cls in (("fedalt", LongerPersonalPhase), ("ditto", ClippedPersonalStep)):
        eng = make_engine(algo)
        check_batchable(eng.algo, eng.model, eng.cfg)
        eng.algo.__class__ = cls
        with pytest.raises(ConfigError, match=f"{cls.__name__}.personal_"):
            check_batchable(eng.algo, eng.model, eng.cfg)


#: the methods compared on 1 and 2 ranks only, not with the sequential run: GradAug's runs in this setting
#: reach rounding events (a ReLU or a resized pixel decided by its last bit) that the sequential path itself
#: reaches when its start moves by a few ulps: on this machine one client of round 0 lands 5e-3 from its
#: sequential twin, and perturbed sequential runs land 5e-3 and 4.7e-3 from it too (at --mu 0.5: 1.2e-7
#: natively, 3.3e-4 under ATEN_CPU_CAPABILITY=default). tests/test_batched_local_learning.py checks it
#: against the sequential path client by client, with the envelope of perturbed sequential runs.
RANKS_ONLY = {"gradaug"}


#: a method drawing its own random numbers (Mixup), a personal one (pMixFed: client state on the rank
#: that trains it), the main job's Mix2FLD (each device's Eq. 2 sums, then the server's conversion),
#: GlobalMix (partners drawn from the pool every rank gathers), StochDepth (each client's own drops, on the
#: residual network: its flags come last and override the CNN), Per-FedAvg (its meta-steps' own batches),
#: GradAug (each client's sub-networks on its own, their dropout masks from its stream: 1 vs 2 ranks only,
#: see RANKS_ONLY).
#: FedProx's anchor and FedPer's personal layers are the same machinery, checked against sequential above.
TWO_RANK_CASES = {"mixup": ["--algo", "mixup", "--gamma", "0.4"], "pmixfed": ["--algo", "pmixfed"],
                  "mix2fld": ["--algo", "mix2fld"], "globalmix": ["--algo", "globalmix", "--mix-alpha", "0.5"],
                  "stochdepth": ["--algo", "stochdepth", "--final-keep-prob", "0.4", "--model", "resnet_digits"],
                  "per_fedavg": ["--algo", "per_fedavg"], "gradaug": ["--algo", "gradaug", "--model", "resnet_digits"]}


def _two_rank_argv(name, clients_at_once, out):
    """The digits CNN with BatchNorm and dropout, clients of unequal sizes, 2 epochs, 2 rounds (lr 0.01,
    momentum 0.5: see test_personal_methods_over_rounds_equal_sequential); the method's flags last (they
    override the model)."""
    return ["--model", "cnn", "--model-opt", "width=4", "--model-opt", "norm=batch",
            "--model-opt", "dropout=0.3", "--partition", "dirichlet:0.5", "--num-clients", "10",
            "--clients-per-round", "8", "--batch-size", "16", "--local-epochs", "2", "--lr", "0.01", "--momentum", "0.5",
            "--weight-decay", "0.001", "--rounds", "2", "--seed", "3", "--threads", "1", "--quiet", "--no-tensorboard",
            *TWO_RANK_CASES[name], "--clients-at-once", str(clients_at_once), "--out", str(out)]


@pytest.fixture(scope="module")
def two_rank_batched(tmp_path_factory):
    """Every TWO_RANK_CASES run with --clients-at-once 3 on 2 MPI ranks, in one launch of
    tests/standard_runner.py (a launch per case cost CI a minute)."""
    import json
    import subprocess
    import sys

    from conftest import REPO, clean_env, mpiexec

    d = tmp_path_factory.mktemp("two_ranks_batched")
    (d / "cases.json").write_text(json.dumps({n: _two_rank_argv(n, 3, d / n) for n in TWO_RANK_CASES}))
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, os.path.join(REPO, "tests", "standard_runner.py"),
                        str(d / "cases.json"), str(d)], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return d


@pytest.mark.parametrize("name", list(TWO_RANK_CASES))
def test_two_ranks_batched_with_dropout_and_batchnorm_equal_one_rank(tmp_path, name, two_rank_batched):
    """--clients-at-once 3 on 1 and 2 ranks, bit for bit (groups are cut before ranks are chosen;
    each client's masks come from its own generator), and within rounding of the sequential run.
    The 1-rank runs here in the test's process, through the same runner the 2-rank launch runs."""
    import json

    from standard_runner import run_case

    from fedhpc.world import World

    def result(out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            losses = [(r["train_loss"], r["test_loss"]) for r in map(json.loads, f)]
        return torch.load(os.path.join(out, "final_model.pt")), losses

    run_case(_two_rank_argv(name, 3, tmp_path / "r1"), World(threads=1))
    (one, one_losses), (two, two_losses) = result(tmp_path / "r1"), result(two_rank_batched / name)
    assert len(one_losses) == 2
    unequal = {n: float((one[n].double() - two[n].double()).abs().max()) for n in one if not torch.equal(one[n], two[n])}
    assert not unequal, unequal
    assert one_losses == two_losses
    if name in RANKS_ONLY:
        return
    run_case(_two_rank_argv(name, 1, tmp_path / "seq"), World(threads=1))
    seq, seq_losses = result(tmp_path / "seq")
    diff = max(float((one[n].double() - seq[n].double()).abs().max()) for n in seq if seq[n].is_floating_point())
    assert diff <= 3 * TOL, diff
    assert all(abs(a[0] - b[0]) <= TOL for a, b in zip(one_losses, seq_losses))
