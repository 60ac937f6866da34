"""The personalised family: layer selection and personal parts over the flat state, FedBABU's
truly frozen head, Per-FedAvg's HF step, the personal state kept per client, personalised
evaluation and cold-start clients against brute-force loops, and both on 2 ranks."""

from __future__ import annotations

import json
import math
import os
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import launch
from fedhpc.algorithms.personal import LayerMap, Part, select_layers, split_layers
from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.errors import ConfigError
from fedhpc.flat import FlatModel
from fedhpc.models import build_model
from fedhpc.run_log import WALL_CLOCK_METRICS
from fedhpc.world import World
from reference_steps import autograd, batch_indices, flat_of
from reference_steps_pmixfed import model_at

#: hand computations compared within tolerances that must hold on any CPU (scripts/test.sh runs them twice)
pytestmark = pytest.mark.cross_cpu

BASE = ["--dataset", "digits", "--num-clients", "8", "--clients-per-round", "3", "--rounds", "2",
        "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05", "--partition", "classes:5",
        "--seed", "2", "--threads", "1", "--quiet", "--no-tensorboard"]
CNN = ["--model", "pmixfed_cnn_digits", "--model-opt", "channels=4"]


def engine(argv):
    cfg, ao, do = parse_args(argv)
    return Engine(cfg, ao, do, World(threads=1))


# ----------------------------------------------------------------------------- selecting layers

NAMES = ["convs.0", "convs.1", "convs.2", "convs.3", "head"]


@pytest.mark.parametrize("spec,want", [
    ("head", [4]), ("base", [0]), ("first:half", [0, 1]), ("last:2", [3, 4]), ("first:0", []),
    ("convs", [0, 1, 2, 3]), ("convs.2, head", [2, 4]), ("first:1,last:1", [0, 4]),
])
def test_layers_are_chosen_by_name(spec, want):
    assert select_layers(NAMES, spec, "--x") == want


def test_bad_selections_name_the_fix():
    with pytest.raises(ConfigError, match="no layer named 'fc'.*convs.0"):
        select_layers(NAMES, "fc", "--personal-layers")
    with pytest.raises(ConfigError, match="must select some but not all"):
        split_layers(NAMES, "convs,head", "--personal-layers")
    with pytest.raises(ConfigError, match="6 of the model's 5"):
        select_layers(NAMES, "last:6", "--x")
    with pytest.raises(ConfigError, match="--shared-layers"):
        engine(["--algo", "fedsim", *BASE, *CNN, "--shared-layers", "first:0"])


def test_a_part_gathers_and_scatters_its_layers_parameters_and_buffers():
    model = build_model("pmixfed_cnn_digits", (1, 8, 8), 10, {"channels": 4})
    flat = FlatModel(model)
    part = Part(LayerMap(model, flat), [1, 4])  # convs.1 (conv, BN and its statistics) and the head
    names = {e.name for e in flat.entries if e.name.startswith(("convs.1.", "head."))}
    assert part.numel == sum(e.numel for e in flat.entries if e.name in names)
    assert any("running_mean" in n for n in names) and len(part.ranges) >= 2   # parameters, later buffers
    vec = torch.arange(flat.numel, dtype=torch.float32)
    compact = part.gather(vec)
    want = torch.cat([vec[e.offset:e.offset + e.numel] for e in flat.entries if e.name in names])
    assert torch.equal(compact, want)
    other = torch.zeros(flat.numel)
    part.scatter_(other, compact)
    for e in flat.entries:
        sl = slice(e.offset, e.offset + e.numel)
        assert torch.equal(other[sl], vec[sl] if e.name in names else torch.zeros(e.numel))


# ----------------------------------------------------------------------------- personal state

def test_partial_methods_keep_only_their_personal_part_per_client():
    eng = engine(["--algo", "fedper", *BASE, *CNN])
    for t in range(2):
        eng.run_round(t)
    head = sum(p.numel() for p in eng.model.head.parameters())
    states = dict(eng.client_state.items())
    assert states and all(s["algo"].numel() == head for s in states.values())
    # the server never touched the personal part: the global head is the initial one
    init = engine(["--algo", "fedper", *BASE, *CNN]).global_state
    ranges = eng.algo.personal.ranges
    assert all(torch.equal(eng.global_state[a:b], init[a:b]) for a, b in ranges)
    assert bytes_per_round(eng) == 2 * 3 * 4 * (eng.flat.numel - head)  # only the shared part travels


def bytes_per_round(eng):
    return eng.algo.ledger.values.sum().item()


# ----------------------------------------------------------------------------- FedBABU

@pytest.mark.parametrize("opt", [["--optimizer", "sgd", "--momentum", "0.9", "--weight-decay", "0.1"],
                                 ["--optimizer", "adam", "--lr", "0.01", "--weight-decay", "0.1"]],
                         ids=["sgd-momentum-wd", "adam-wd"])
def test_fedbabu_head_is_bit_identical_after_federated_training(opt):
    eng = engine(["--algo", "fedbabu", *BASE, *CNN, "--rounds", "3", *opt])
    init = eng.global_state.clone()
    head = eng.algo.head
    for t in range(2):
        eng.run_round(t)
        # the last client trained in place: its head is still the initial one, bit for bit
        assert all(torch.equal(eng.flat.flat[a:b], init[a:b]) for a, b in head.ranges)
    assert all(torch.equal(eng.global_state[a:b], init[a:b]) for a, b in head.ranges)
    assert float((eng.global_state - init).abs().max()) > 1e-3            # the body did train
    assert eng.algo.client_model(0) is None                               # not the final evaluation
    eng.run_round(2)
    eng.algo.final_evaluation = True                                      # as the engine sets it at the end
    tuned = eng.algo.client_model(0)                                      # the end: fine-tuned
    assert float(max((tuned[a:b] - init[a:b]).abs().max() for a, b in head.ranges)) > 1e-4


@pytest.mark.parametrize("stop", ["after-all-rounds", "converged-early"])
def test_fedbabu_fine_tunes_every_client_once_at_the_final_evaluation(stop, monkeypatch):
    """Fine-tuning at the end means the evaluation the run ends with, also when --stop-epsilon
    ends it before --rounds (it used to be skipped then: the last round never came)."""
    from fedhpc.algorithms.fedbabu import FedBABU
    early = ["--stop-epsilon", "1e9"] if stop == "converged-early" else []
    eng = engine(["--algo", "fedbabu", *BASE, *CNN, "--rounds", "4", "--eval-every", "1", *early])
    tuned, evaluated = [], []
    original, evaluate = FedBABU.fine_tune, eng.evaluate
    monkeypatch.setattr(FedBABU, "fine_tune", lambda self, model, ctx: (tuned.append((len(evaluated), ctx.cid)),
                                                                      original(self, model, ctx))[1])
    monkeypatch.setattr(eng, "evaluate", lambda *round_number: (evaluated.append(1), evaluate(*round_number))[1])
    final = eng.run()
    ends = 2 if early else 4          # the relative change needs two rounds, and 1e9 is then met
    assert final["round"] == ends and len(evaluated) == ends
    assert sorted(tuned) == [(ends, cid) for cid in range(8)]           # all 8 clients, at the last evaluation only
    assert final["local_test_accuracy"] != final["local_test_accuracy_global_model"]


# ----------------------------------------------------------------------------- Per-FedAvg HF

def test_per_fedavg_hf_meta_gradient_against_an_exact_hessian_vector_product():
    eng = engine(["--algo", "per_fedavg", *BASE, "--model", "mlp", "--variant", "hf", "--alpha", "0.1"])
    algo, c = eng.algo, eng.data.client(0)
    idx = batch_indices(eng.cfg.seed, 0, 0, 0, c.num_train, 16)[:3]
    batches = [(c.x[i], c.y[i]) for i in idx]
    w = eng.flat.flat.clone()
    from fedhpc.algorithms.base import ClientContext, RoundInfo
    ctx = ClientContext(algo, 0, c, RoundInfo(0, [0], [0], 0.05))
    _, got = algo.meta_gradient(eng.model, batches, ctx)
    assert torch.equal(eng.flat.flat, w)                                  # restored before the meta step
    # by hand, float64: (I - alpha H(w; D3)) grad f(w - alpha grad f(w; D1); D2), H v exact
    m = model_at(eng, w.double())
    xs = [(b[0].double(), b[1]) for b in batches]
    g1 = autograd(m, F.cross_entropy(m(xs[0][0]), xs[0][1]))
    m2 = model_at(eng, w.double())
    with torch.no_grad():
        for p, g in zip(m2.parameters(), g1):
            p -= 0.1 * g
    g2 = autograd(m2, F.cross_entropy(m2(xs[1][0]), xs[1][1]))
    gd = torch.autograd.grad(F.cross_entropy(m(xs[2][0]), xs[2][1]), list(m.parameters()), create_graph=True)
    hv = torch.autograd.grad(sum((a * v).sum() for a, v in zip(gd, g2)), list(m.parameters()))
    want = [a - 0.1 * h for a, h in zip(g2, hv)]
    err = max(float((x.double() - y).abs().max()) for x, y in zip(got, want))
    scale = max(float(y.abs().max()) for y in want)
    assert err < 1e-3 * scale
    # the Hessian term matters: the first-order gradient alone is further off
    assert max(float((x - y).abs().max()) for x, y in zip(g2, want)) > 10 * err


def test_per_fedavg_hf_takes_both_finite_differences_with_the_same_dropout_masks():
    """With dropout, H v is the Hessian of the network under ONE mask: the two passes at w +- d v
    must draw the same masks, else their difference is mask noise amplified by alpha / (2 d)."""
    eng = engine(["--algo", "per_fedavg", *BASE, "--model", "cnn", "--model-opt", "dropout=0.5",
                  "--variant", "hf", "--alpha", "0.1"])
    algo, c = eng.algo, eng.data.client(0)
    idx = batch_indices(eng.cfg.seed, 0, 0, 0, c.num_train, 16)[:3]
    batches = [(c.x[i], c.y[i]) for i in idx]
    from fedhpc.algorithms.base import ClientContext, RoundInfo
    ctx = ClientContext(algo, 0, c, RoundInfo(0, [0], [0], 0.05))
    dropout = [m for m in eng.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(dropout) == 1
    masks = []
    dropout[0].register_forward_hook(lambda mod, inp, out: masks.append((inp[0] != 0) & (out == 0)))
    eng.model.train()
    torch.default_generator.manual_seed(123)
    algo.meta_gradient(eng.model, batches, ctx)
    assert len(masks) == 4                                    # D1 at w, D2 at w', D3 at w + d g and at w - d g
    assert masks[0].shape == masks[1].shape and not torch.equal(masks[0], masks[1])   # masks do vary by pass
    assert masks[2].any() and torch.equal(masks[2], masks[3])                        # but not between the two
    # and the generator moves on afterwards as after one pass, so later batches get fresh masks
    after = torch.default_generator.get_state()
    torch.default_generator.manual_seed(123)
    algo.options.variant = "fo"
    algo.meta_gradient(eng.model, batches[:2], ctx)
    eng.model(batches[2][0].to(eng.flat.flat.dtype))
    assert torch.equal(torch.default_generator.get_state(), after)


# ----------------------------------------------------------------------------- personalised evaluation

def brute_force_local(eng, clients=None):
    """Each trained client's own model (or the global one) on its own split, by a plain loop."""
    per, pooled, glob = {}, [0, 0], 0
    for cid in eng.training_clients if clients is None else clients:
        x, y = eng.data.client_test_split(cid)
        if len(y) == 0:
            continue
        own = eng.algo.client_model(cid)
        with torch.no_grad():
            m = model_at(eng, (eng.global_state if own is None else own).double()).eval()
            hits = [int(m(x[i:i + 1].double()).argmax()) == int(y[i]) for i in range(len(y))]
            g = model_at(eng, eng.global_state.double()).eval()
            glob += sum(int(g(x[i:i + 1].double()).argmax()) == int(y[i]) for i in range(len(y)))
        per[cid] = sum(hits) / len(hits)
        pooled[0] += sum(hits)
        pooled[1] += len(hits)
    accs = sorted(per.values())
    mean = sum(accs) / len(accs)
    k = math.ceil(0.1 * len(accs))
    return {"local_test_accuracy": pooled[0] / pooled[1], "local_test_accuracy_mean": mean,
            "local_test_accuracy_std": math.sqrt(sum((a - mean) ** 2 for a in accs) / len(accs)),
            "local_test_accuracy_worst10": sum(accs[:k]) / k,
            "local_test_accuracy_global_model": glob / pooled[1]}


@pytest.mark.parametrize("algo", ["fedper", "ditto", "per_fedavg"])
def test_personalised_evaluation_equals_a_loop_over_clients(algo):
    eng = engine(["--algo", algo, *BASE, "--model", "mlp", "--cold-start-fraction", "0.25"])
    for t in range(2):
        eng.run_round(t)
    got = eng.evaluate()
    want = brute_force_local(eng)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-12), k
    assert got["local_test_accuracy_mean"] != pytest.approx(got["local_test_accuracy_global_model"])


@pytest.mark.parametrize("eval_batch", ["7", "1000"])
def test_the_global_model_on_every_local_split_is_the_loop_over_clients_on_any_rank_count(eval_batch, monkeypatch):
    """The global model's pass over the clients' local test splits lays them end to end and cuts
    eval batches that straddle clients (7 samples) or hold them all (1000); each rank takes a run
    of whole batches. Per client and summed over 1, 2 or 3 ranks, the counts are a sample-by-sample
    loop's (float64), and the reported accuracies are fedavg's (no client model of its own)."""
    eng = engine(["--algo", "fedavg", *BASE, "--model", "mlp", "--cold-start-fraction", "0.25",
                  "--eval-batch-size", eval_batch])
    for t in range(2):
        eng.run_round(t)
    want = brute_force_local(eng)
    got = eng.evaluate()
    assert "local_test_accuracy_global_model" not in got  # no client has a model of its own
    for k in ("local_test_accuracy", "local_test_accuracy_mean", "local_test_accuracy_std",
              "local_test_accuracy_worst10"):
        assert got[k] == pytest.approx(want[k], abs=1e-12), k
    g = model_at(eng, eng.global_state.double()).eval()
    loop = torch.zeros(2, eng.data.num_clients, dtype=torch.float64)
    for cid in eng.cold_start:  # the held-out clients, as their end-of-run evaluation asks
        x, y = eng.data.client_test_split(cid)
        with torch.no_grad():
            loop[0, cid] = sum(int(g(x[i:i + 1].double()).argmax()) == int(y[i]) for i in range(len(y)))
        loop[1, cid] = len(y)
    assert loop[1].sum() > 0
    for size in (1, 2, 3):
        summed = torch.zeros(2, eng.data.num_clients, dtype=torch.float64)
        for rank in range(size):
            monkeypatch.setattr(eng, "world", types.SimpleNamespace(rank=rank, size=size, device=torch.device("cpu")))
            eng._add_global_model_hits(summed, 0, 1, eng.cold_start)
        assert torch.equal(summed, loop), (size, summed, loop)


@pytest.mark.parametrize("algo", ["fedavg", "ditto"])
def test_next_character_local_evaluation_counts_every_position_of_every_client(algo, tmp_path):
    """Shakespeare (targets: one character per sequence position): a client's local accuracy is
    over all positions of its sequences, for the global model's pass over the splits laid end to
    end (eval batches of 3 sequences straddle clients) and for own models, as a per-client loop."""
    from test_formats import write_tff_shakespeare
    write_tff_shakespeare(str(tmp_path / "shakespeare"))
    eng = engine(["--algo", algo, "--dataset", "shakespeare", "--data-dir", str(tmp_path), "--model", "lstm_char",
                  "--model-opt", "embed_dim=4", "--model-opt", "hidden=8", "--model-opt", "num_layers=1",
                  "--data-opt", "seq_len=8", "--partition", "natural", "--num-clients", "3",
                  "--clients-per-round", "3", "--rounds", "1", "--batch-size", "4", "--lr", "0.5",
                  "--client-test-fraction", "0.4", "--eval-batch-size", "3", "--threads", "1", "--quiet",
                  "--no-tensorboard"])
    eng.run_round(0)
    got = eng.evaluate()
    hits, counts, accs = 0, 0, []
    for cid in eng.training_clients:
        x, y = eng.data.client_test_split(cid)
        if len(y) == 0:
            continue
        own = eng.algo.client_model(cid)
        eng.flat.load_(eng.global_state if own is None else own)
        eng.model.eval()
        with torch.no_grad():
            right = sum(int((eng.model(eng.data.transform(x[i:i + 1], False, None)).argmax(-1) == y[i:i + 1]).sum())
                        for i in range(len(y)))
        hits, counts = hits + right, counts + y.numel()
        accs.append(right / y.numel())
    assert y.shape[1] == 8 and len(accs) >= 2
    assert got["local_test_accuracy"] == pytest.approx(hits / counts, abs=1e-12)
    assert got["local_test_accuracy_mean"] == pytest.approx(sum(accs) / len(accs), abs=1e-12)


def test_a_sampled_local_evaluation_covers_its_seeded_clients_and_the_last_one_every_client(tmp_path):
    """--local-eval-clients 3: each non-final evaluation covers 3 of the 6 training clients,
    drawn by (seed, round) and equal to a loop over them; the final one covers all, and the run
    trains, ends and resumes exactly as without sampling."""
    argv = ["--algo", "ditto", *BASE, "--model", "mlp", "--cold-start-fraction", "0.25", "--rounds", "3"]
    eng = engine(argv + ["--local-eval-clients", "3"])
    samples = [eng._local_eval_clients(r) for r in (1, 2, 3)]
    for s in samples:
        assert len(s) == 3 and s == sorted(s) and set(s) <= set(eng.training_clients)
    assert len({tuple(s) for s in samples}) > 1, "the sample must move with the round"
    other_seed = engine(argv + ["--local-eval-clients", "3", "--seed", "3"])
    assert [other_seed._local_eval_clients(r) for r in (1, 2, 3)] != samples, "the seed must fix the sample"
    eng.run_round(0)
    got = eng.evaluate(1)
    want = brute_force_local(eng, samples[0])
    assert got["local_eval_clients"] == 3
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-12), k
    eng.algo.final_evaluation = True                    # the run's last evaluation: every client
    assert eng._local_eval_clients(1) == eng.training_clients and "local_eval_clients" not in eng.evaluate(1)
    eng.algo.final_evaluation = False

    def rows(out):
        return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK_METRICS}
                for line in open(os.path.join(out, "metrics.jsonl"))]

    runs = {}
    for name, extra in (("all", []), ("sampled", ["--local-eval-clients", "3"])):
        out = str(tmp_path / name)
        e = engine(argv + extra + ["--out", out])
        e.run()
        runs[name] = (e.global_state.clone(), rows(out))
    assert torch.equal(runs["all"][0], runs["sampled"][0])
    (all_rows, sampled_rows) = runs["all"][1], runs["sampled"][1]
    assert [r.get("local_eval_clients") for r in sampled_rows] == [3, 3, None]
    assert sampled_rows[-1] == all_rows[-1]
    assert sampled_rows[0]["local_test_accuracy_mean"] != all_rows[0]["local_test_accuracy_mean"] or \
        sampled_rows[1]["local_test_accuracy_mean"] != all_rows[1]["local_test_accuracy_mean"]
    # interrupted after round 2 (checkpointed every round) and resumed: the same rows
    out = str(tmp_path / "resumed")
    engine(argv + ["--local-eval-clients", "3", "--out", out, "--rounds", "2", "--checkpoint-every", "1"]).run()
    engine(argv + ["--local-eval-clients", "3", "--out", out, "--resume"]).run()
    assert rows(out) == sampled_rows
    with pytest.raises(ConfigError, match=r"--local-eval-clients must be >= 0 \(0 = every client\), got -1"):
        parse_args(argv + ["--local-eval-clients", "-1"])


@pytest.mark.parametrize("stop", ["after-all-rounds", "converged-early"])
def test_cold_start_clients_join_after_the_last_round_run(stop, monkeypatch):
    """Cold-start clients adapt with the round index and decayed learning rate of the end of
    the run: --rounds, or the round where --stop-epsilon ended it (it used to be --rounds always)."""
    early = ["--stop-epsilon", "1e9"] if stop == "converged-early" else []
    eng = engine(["--algo", "per_fedavg", *BASE, "--model", "mlp", "--cold-start-fraction", "0.25",
                  "--rounds", "4", "--lr-decay", "0.9", *early])
    seen = []
    monkeypatch.setattr(type(eng.algo), "adapt", lambda self, model, ctx: seen.append((ctx.cid, ctx.round.index, ctx.lr)))
    final = eng.run()
    end = 2 if early else 4
    assert final["round"] == end and final["cold_start_clients"] == 2
    assert sorted(seen) == [(cid, end, pytest.approx(0.05 * 0.9 ** end)) for cid in sorted(eng.cold_start)]


def test_cold_start_clients_adapt_then_report_both_gaps():
    """Per-FedAvg's cold-start adaptation is one SGD step of size alpha on the client's first
    batch (round index T); the participation gap is trained mean minus cold-start mean."""
    eng = engine(["--algo", "per_fedavg", *BASE, "--model", "mlp", "--cold-start-fraction", "0.25", "--alpha", "0.2"])
    cold = eng.cold_start
    assert len(cold) == 2 and not set(cold) & set(eng.training_clients)
    for t in range(2):
        eng.run_round(t)
    local = eng.evaluate()
    got = eng._evaluate_cold_start(local)
    before, after, counts = [], [], []
    for cid in cold:
        c = eng.data.client(cid)
        first = batch_indices(eng.cfg.seed, eng.cfg.rounds, cid, 0, c.num_train, eng.cfg.batch_size)[0]
        m = model_at(eng, eng.global_state.double())
        x, y = eng.data.client_test_split(cid)
        with torch.no_grad():
            before.append(int((m(x.double()).argmax(-1) == y).sum()))
        g = autograd(m, F.cross_entropy(m(c.x[first].double()), c.y[first]))
        with torch.no_grad():
            for p, gi in zip(m.parameters(), g):
                p -= 0.2 * gi
            after.append(int((m(x.double()).argmax(-1) == y).sum()))
        counts.append(len(y))
    assert got["cold_start_accuracy"] == pytest.approx(sum(after) / sum(counts), abs=1e-12)
    assert got["cold_start_accuracy_global_model"] == pytest.approx(sum(before) / sum(counts), abs=1e-12)
    mean_after = sum(a / n for a, n in zip(after, counts)) / len(cold)
    assert got["participation_gap"] == pytest.approx(local["local_test_accuracy_mean"] - mean_after, abs=1e-12)
    assert after != before  # the adaptation step changed predictions


def test_final_adapt_adapts_the_final_global_model_for_every_trained_client():
    """--final-adapt (pMixFed App. 10.1): each trained client takes the final global model, runs
    the method's adaptation (Per-FedAvg: one SGD step of size alpha on its first batch of round
    T) and is evaluated on its own split; the clients' kept models are reported beside it."""
    eng = engine(["--algo", "per_fedavg", *BASE, "--model", "mlp", "--alpha", "0.2", "--final-adapt"])
    for t in range(2):
        eng.run_round(t)
    got = eng._evaluate_final_adapted()
    accs, hits, counts = [], 0, 0
    for cid in eng.training_clients:
        c = eng.data.client(cid)
        x, y = eng.data.client_test_split(cid)
        if len(y) == 0:
            continue
        first = batch_indices(eng.cfg.seed, eng.cfg.rounds, cid, 0, c.num_train, eng.cfg.batch_size)[0]
        m = model_at(eng, eng.global_state.double())
        g = autograd(m, F.cross_entropy(m(c.x[first].double()), c.y[first]))
        with torch.no_grad():
            for p, gi in zip(m.parameters(), g):
                p -= 0.2 * gi
            right = int((m(x.double()).argmax(-1) == y).sum())
        accs.append(right / len(y))
        hits, counts = hits + right, counts + len(y)
    assert len(accs) == len(eng.training_clients) == 8
    assert got["local_test_accuracy_adapted"] == pytest.approx(hits / counts, abs=1e-12)
    assert got["local_test_accuracy_adapted_mean"] == pytest.approx(sum(accs) / len(accs), abs=1e-12)
    worst = sorted(accs)[0]   # ceil(10% of 8) = 1 client
    assert got["local_test_accuracy_adapted_worst10"] == pytest.approx(worst, abs=1e-12)
    with pytest.raises(ConfigError, match="--final-adapt"):
        parse_args(["--final-adapt", "--client-test-fraction", "0"])


@pytest.mark.parametrize("epochs", [0, 2])
def test_fedavg_fine_tunes_all_layers_under_final_adapt(epochs):
    """App. 10.1: FedAvg's personalisation "simply involves updating all layers jointly": each
    trained client takes the final global model through --finetune-epochs epochs of plain SGD on
    its batches of round T; 0 leaves the global model as it is."""
    eng = engine(["--algo", "fedavg", *BASE, "--model", "mlp", "--final-adapt", "--finetune-epochs", str(epochs),
                  "--lr-decay", "0.9"])
    for t in range(2):
        eng.run_round(t)
    got = eng._evaluate_final_adapted()
    lr = 0.05 * 0.9 ** eng.cfg.rounds
    accs, global_accs = [], []
    for cid in eng.training_clients:
        c = eng.data.client(cid)
        x, y = eng.data.client_test_split(cid)
        m = model_at(eng, eng.global_state.double())
        with torch.no_grad():
            global_accs.append(int((m(x.double()).argmax(-1) == y).sum()) / len(y))
        for epoch in range(epochs):
            for idx in batch_indices(eng.cfg.seed, eng.cfg.rounds, cid, epoch, c.num_train, eng.cfg.batch_size):
                g = autograd(m, F.cross_entropy(m(c.x[idx].double()), c.y[idx]))
                with torch.no_grad():
                    for p, gi in zip(m.parameters(), g):
                        p -= lr * gi
        with torch.no_grad():
            accs.append(int((m(x.double()).argmax(-1) == y).sum()) / len(y))
    assert got["local_test_accuracy_adapted_mean"] == pytest.approx(sum(accs) / len(accs), abs=1e-12)
    if epochs == 0:
        assert accs == global_accs
    else:
        assert accs != global_accs, "two epochs of fine-tuning must change some client's predictions"


# ----------------------------------------------------------------------------- 2 ranks

def test_personal_state_evaluation_and_cold_start_on_two_ranks(tmp_path):
    """pMixFed with its personal models, personalised evaluation, cold-start adaptation and
    --final-adapt: the metrics of 1 and 2 MPI ranks agree (state migrates between ranks every round)."""
    args = ["--algo", "pmixfed", *BASE, "--model", "cnn", "--model-opt", "width=4", "--model-opt", "hidden=16",
            "--model-opt", "norm=batch", "--rounds", "3", "--clients-per-round", "4",
            "--cold-start-fraction", "0.25", "--finetune-epochs", "1", "--final-adapt",
            "--eval-batch-size", "7"]  # the global model's eval batches straddle clients and ranks
    rows = {}
    for ranks in (1, 2):
        out = tmp_path / f"r{ranks}"
        p = launch(args + ["--out", str(out)], ranks=ranks, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        rows[ranks] = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    last1, last2 = rows[1][-1], rows[2][-1]
    keys = [k for k in last1 if k.startswith(("local_test", "cold_start", "participation", "mu_", "acc_", "test_acc"))]
    assert "cold_start_accuracy" in keys and "local_test_accuracy_mean" in keys
    assert "local_test_accuracy_adapted_mean" in keys   # trained clients adapt where their state lives
    for k in keys:
        assert last1[k] == pytest.approx(last2[k], abs=1e-9), k


@pytest.mark.parametrize("algo", ["fedper", "per_fedavg"])
def test_resuming_a_finished_run_reports_the_same_personalised_metrics(algo, tmp_path):
    """A finished run resumed with the same rounds reports its final record from the checkpoint;
    evaluated straight from the checkpoint, the personal models must be built from the restored
    global state, not from none, and give those numbers."""
    out = str(tmp_path / "run")
    argv = ["--algo", algo, *BASE, "--model", "mlp", "--out", out]
    first = engine(argv).run()
    again = engine(argv + ["--resume"]).run()
    restored = engine(argv + ["--resume"])
    restored.restore()
    restored.algo.final_evaluation = True
    evaluated = restored.evaluate()
    for k in ("test_accuracy", "local_test_accuracy_mean", "local_test_accuracy_global_model"):
        assert again[k] == first[k], k
        assert evaluated[k] == first[k], k


@pytest.mark.parametrize("algo", ["fedper", "lg_fedavg"])
def test_a_partial_method_leads_its_final_line_with_the_clients_own_models(algo, tmp_path):
    """The global state of FedPer / LG-FedAvg pairs the averaged shared layers with the initial
    personal ones: its test accuracy is logged, but the result the run announces is the clients'."""
    from conftest import FAST

    p = launch([a for a in FAST if a != "--quiet"] + ["--algo", algo, "--rounds", "1", "--out", str(tmp_path / "o")])
    assert p.returncode == 0, p.stderr
    final = [line for line in p.stdout.splitlines() if line.startswith("final")]
    assert len(final) == 1 and final[0].startswith("final mean accuracy of the clients' own models"), p.stdout
    assert "initial personal part): test accuracy" in final[0]


# ----------------------------------------------------------------------------- which layers are personal

def by_name(eng, flat):
    """{parameter name: its slice of the flat state} (float64)."""
    return {e.name: flat[e.offset:e.offset + e.numel].double() for e in eng.flat.entries}


def test_lg_fedavg_keeps_the_representation_layers_per_client_and_averages_the_top_layer():
    """LG-FedAvg (the paper's reading, --global-layers head by default): the local representation
    (blocks.0, blocks.1 of a 3-block MLP) stays with each client, the top layer (head) is averaged.
    After a round, checked parameter by parameter against what each client trained (read off the
    model it uploads from): the global head is the n_k-weighted mean of the clients' heads and its
    blocks are still the initial ones; every client keeps its own blocks (different per client)
    under the global head; and a client sampled again starts from its own blocks."""
    eng = engine(["--algo", "lg_fedavg", *BASE, "--model", "mlp", "--model-opt", "depth=3"])
    init = by_name(eng, eng.global_state.clone())
    trained, starts = {}, {}
    upload, local_update = eng.algo.upload, eng.algo.local_update

    def spy_upload(model, ctx):
        trained[(ctx.round.index, ctx.cid)] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        return upload(model, ctx)

    def spy_local_update(model, ctx):
        starts[(ctx.round.index, ctx.cid)] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        return local_update(model, ctx)

    eng.algo.upload, eng.algo.local_update = spy_upload, spy_local_update
    eng.run_round(0)
    first = sorted(c for t, c in trained if t == 0)
    assert len(first) == 3
    g = by_name(eng, eng.global_state)
    sizes = {cid: eng.data.client(cid).num_train for cid in first}
    for name in ("head.weight", "head.bias"):
        mean = sum(sizes[c] * trained[(0, c)][name] for c in first) / sum(sizes.values())
        assert float((g[name] - mean.reshape(-1)).abs().max()) <= 1e-6, name
        assert float((g[name] - init[name]).abs().max()) > 1e-3, f"{name}: the global top layer must move"
    for name in ("blocks.0.0.weight", "blocks.0.0.bias", "blocks.1.0.weight", "blocks.1.0.bias"):
        assert torch.equal(g[name], init[name]), f"{name}: a representation layer was aggregated"
    for cid in first:
        mine = by_name(eng, eng.algo.client_model(cid))
        for name in mine:
            want = g[name] if name.startswith("head.") else trained[(0, cid)][name].reshape(-1)
            assert float((mine[name] - want).abs().max()) <= 1e-7, (cid, name)
    for a, b in zip(first, first[1:]):  # kept layers are each client's own
        assert float((trained[(0, a)]["blocks.0.0.weight"] - trained[(0, b)]["blocks.0.0.weight"]).abs().max()) > 1e-3
    eng.run_round(1)
    again = [c for t, c in starts if t == 1 and c in first]
    assert again, "the check needs a client sampled in both rounds"
    for cid in again:
        s = starts[(1, cid)]
        for name in s:
            want = g[name] if name.startswith("head.") else trained[(0, cid)][name].reshape(-1)
            assert float((s[name].reshape(-1) - want).abs().max()) <= 1e-7, (cid, name)
    assert eng.algo.personal.names == ["blocks.0", "blocks.1"] and eng.algo.shared.names == ["head"]


def ditto_round_by_hand(eng, cid, t, v, w, anchor):
    """Ditto's round ``t`` for client ``cid`` in float64 (Alg. 1, personal_steps 1, plain SGD): per
    batch one step of v on F(v) + lam/2 ||v - a||^2, then one of w on F(w). ``anchor`` is the
    flat state a, or "local" for the client's own, locally updated copy of the global model."""
    cfg, lam = eng.cfg, eng.algo.options.lam
    c = eng.data.client(cid)
    x, y = c.x.double(), c.y
    vm, wm = model_at(eng, v.double()), model_at(eng, w.double())
    fixed = None if anchor == "local" else [p.detach().clone() for p in model_at(eng, anchor.double()).parameters()]
    for idx in batch_indices(cfg.seed, t, cid, 0, c.num_train, cfg.batch_size):
        a = [p.detach().clone() for p in wm.parameters()] if fixed is None else fixed
        gv = autograd(vm, F.cross_entropy(vm(x[idx]), y[idx]))
        with torch.no_grad():
            for p, gr, ap in zip(vm.parameters(), gv, a):
                p -= cfg.lr * (gr + lam * (p - ap))
        gw = autograd(wm, F.cross_entropy(wm(x[idx]), y[idx]))
        with torch.no_grad():
            for p, gr in zip(wm.parameters(), gw):
                p -= cfg.lr * gr
    return flat_of(eng, vm)


def test_ditto_pulls_the_personal_model_towards_the_rounds_global_model():
    """Ditto's proximal term lam (v - w^t) anchors v at the global model w^t the round started from:
    not at the client's previous personal model, nor at its locally updated copy of the global
    model. Round 2 of a client whose v (from round 1) differs from w^t, by hand against the three
    anchors: the engine's v is the first, and far from the other two."""
    eng = engine(["--algo", "ditto", *BASE, "--model", "mlp", "--num-clients", "3", "--clients-per-round", "3",
                  "--lam", "1.0", "--personal-steps", "1"])
    eng.run_round(0)
    cid = 0
    v_prev, w_t = eng.algo.client_model(cid).clone(), eng.global_state.clone()
    assert float((v_prev - w_t).abs().max()) > 1e-2
    want = ditto_round_by_hand(eng, cid, 1, v_prev, w_t, w_t)
    wrong = {"previous personal model": ditto_round_by_hand(eng, cid, 1, v_prev, w_t, v_prev),
             "locally updated global copy": ditto_round_by_hand(eng, cid, 1, v_prev, w_t, "local")}
    eng.run_round(1)
    got = eng.algo.client_model(cid).double()
    moved = float((want - v_prev.double()).abs().max())
    tol = max(2e-5, 2e-3 * moved)
    assert float((got - want).abs().max()) <= tol, (float((got - want).abs().max()), tol)
    for what, other in wrong.items():
        assert float((other - want).abs().max()) > 10 * tol, f"the check cannot tell the anchor from the {what}"
