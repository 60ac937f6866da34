"""FedAlign's second-order analysis (fedhpc/analysis/hessian*.py, Sec. 3.4) against exact Hessians.

Exact Hessians come from ``torch.autograd.functional.hessian`` of the loss as a function of
the flat parameter vector (``torch.func.functional_call``): nothing of the tool's HVP code.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from conftest import REPO, clean_env, mpiexec
from fedhpc.analysis.hessian import RunAnalysis, main, saved_clients
from fedhpc.analysis.hessian_estimators import (Objective, hessian_diagonal, hessian_matching, hutchinson_trace,
                                                layerwise, rademacher, top_eigenvalue)
from fedhpc.algorithms.base import derive_seed
from fedhpc.world import World


def exact_hessian(model, batches):
    """H of mean CE over all samples of ``batches`` (sequence outputs (B, T, V): over all B * T targets,
    as training's loss), parameters flattened in model.parameters() order."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])

    def loss(flat):
        params = {n: t.view(s) for n, t, s in zip(names, torch.split(flat, sizes), shapes)}
        out = functional_call(model, params, (x,))
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    return torch.autograd.functional.hessian(loss, flat)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()
    x, y = torch.randn(40, 6, dtype=torch.float64), torch.randint(0, 3, (40,))
    batches = [(x[s:s + 7], y[s:s + 7]) for s in range(0, 40, 7)]  # uneven batches
    return model, batches, exact_hessian(model, batches)


def test_hvp_is_the_exact_hessian_times_v(tiny):
    model, batches, H = tiny
    obj = Objective(model, batches, 40)
    assert obj.numel == H.shape[0] == 43
    v = torch.randn(43, dtype=torch.float64)
    assert torch.allclose(obj.hvp(v), H @ v, atol=1e-12)
    # data split over two "ranks" and summed equals the whole
    halves = [Objective(model, batches[:3], 40), Objective(model, batches[3:], 40)]
    assert torch.allclose(halves[0].hvp(v) + halves[1].hvp(v), H @ v, atol=1e-12)


def whole(tiny):
    """The tiny problem as one batch (the estimators below need many HVPs)."""
    model, batches, H = tiny
    return model, Objective(model, [(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))], 40), H


def test_top_eigenvalue_and_trace(tiny):
    model, obj, H = whole(tiny)
    evals, evecs = torch.linalg.eigh(H)
    top = int(evals.abs().argmax())
    eig, vec, steps = top_eigenvalue(obj, iters=2000, tol=1e-13, seed=1)
    assert abs(eig - float(evals[top])) < 1e-8 * abs(float(evals[top]))
    assert abs(abs(float(vec @ evecs[:, top])) - 1) < 1e-6
    # the default stopping rule stops early, within tol of the answer
    eig_fast, _, steps_fast = top_eigenvalue(obj, iters=100, tol=1e-3, seed=1)
    assert steps_fast < 100 and abs(eig_fast - float(evals[top])) < 0.05 * abs(float(evals[top]))
    # Hutchinson: exactly the mean of z^T H z over its documented stream, and near tr(H)
    n = 1500
    est, used = hutchinson_trace(obj, iters=n, tol=0.0, seed=2)
    gen = torch.Generator().manual_seed(derive_seed(2, "hutchinson"))
    zs = torch.stack([rademacher(43, gen) for _ in range(n)])
    assert used == n and abs(est - float(((zs @ H) * zs).sum(1).mean())) < 1e-10
    off = H - torch.diag(torch.diag(H))
    sd = math.sqrt(2 * float((off ** 2).sum()) / n)
    assert abs(est - float(torch.trace(H))) < 5 * sd


def test_diagonals_true_and_layerwise(tiny):
    model, obj, H = whole(tiny)
    exact = hessian_diagonal(obj, method="exact")
    assert torch.allclose(exact, torch.diag(H), atol=1e-12)
    n = 1500
    est = hessian_diagonal(obj, samples=n, seed=3, key=7)
    gen = torch.Generator().manual_seed(derive_seed(3, "hessian_diag", 7))
    zs = torch.stack([rademacher(43, gen) for _ in range(n)])
    assert torch.allclose(est, (zs * (zs @ H)).mean(0), atol=1e-12)  # H symmetric: (H z)^T = z^T H
    off_sq = (H ** 2).sum(1) - torch.diag(H) ** 2  # variance of z_i (Hz)_i
    assert ((est - torch.diag(H)).abs() <= 5 * (off_sq / n).sqrt() + 1e-12).all()
    # the authors' layer-wise reading: one number per parameter tensor, the block's trace
    blocks = layerwise(exact, obj.sizes)
    assert blocks.shape == (4,)
    bounds = [0, 24, 28, 40, 43]
    assert torch.allclose(blocks, torch.stack([torch.diag(H)[a:b].sum() for a, b in zip(bounds, bounds[1:])]))


def test_hessian_matching_by_brute_force():
    g = torch.Generator().manual_seed(4)
    diags = [torch.randn(10, generator=g, dtype=torch.float64) for _ in range(4)]
    hn, hd = {}, {}
    for mode, pairs in (("distinct", [(k, j) for k in range(4) for j in range(k + 1, 4)]),
                        ("all", [(k, j) for k in range(4) for j in range(4)])):
        n = [math.sqrt(sum(float(v) ** 2 for v in d)) for d in diags]
        hn[mode] = sum((n[k] - n[j]) ** 2 for k, j in pairs) / len(pairs)
        hd[mode] = sum(sum(float(a) * float(b) for a, b in zip(diags[k], diags[j])) / (n[k] * n[j])
                       for k, j in pairs) / len(pairs)
        got = hessian_matching(diags, mode)
        assert abs(got[0] - hn[mode]) < 1e-12 and abs(got[1] - hd[mode]) < 1e-12
    assert hn["all"] < hn["distinct"] and hd["all"] > hd["distinct"]  # k = j pulls them to 0 and 1


def test_batchnorm_model_in_eval_mode_does_not_depend_on_batching():
    from fedhpc.models import build_model

    torch.manual_seed(5)
    model = build_model("resnet_digits", (1, 8, 8), 10, {"width": 2}).double()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.3, 0.3); m.running_var.uniform_(0.5, 1.5)
    model.eval()
    x, y = torch.rand(30, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (30,))
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    a = Objective(model, [(x, y)], 30).hvp(v)
    b = Objective(model, [(x[s:s + 4], y[s:s + 4]) for s in range(0, 30, 4)], 30).hvp(v)
    assert torch.allclose(a, b, atol=1e-10) and float(a.abs().max()) > 1e-6


# ----------------------------------------------------------------------------- the command on a run

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Two rounds of Mixup on the digits with a 160-parameter MLP, client models saved."""
    from fedhpc.config import parse_args
    from fedhpc.engine import Engine

    out = str(tmp_path_factory.mktemp("hess") / "run")
    argv = ["--algo", "mixup", "--dataset", "digits", "--model", "mlp", "--model-opt", "hidden=2",
            "--num-clients", "4", "--clients-per-round", "3", "--rounds", "2", "--local-epochs", "1",
            "--batch-size", "32", "--lr", "0.1", "--partition", "dirichlet:1.0", "--seed", "2",
            "--threads", "1", "--quiet", "--no-tensorboard", "--save-client-models", "last", "--out", out]
    Engine(*parse_args(argv), World(threads=1)).run()
    return out


ARGS = ["--dtype", "float64", "--batches", "3", "--batch-size", "50", "--iters", "2000", "--tol", "1e-13",
        "--trace-iters", "20", "--trace-tol", "0", "--diag-method", "exact", "--threads", "1"]


def test_command_against_exact_hessians(run_dir, tmp_path):
    out = str(tmp_path / "h.json")
    assert main([run_dir, *ARGS, "--out", out]) == 0
    res = json.load(open(out))
    run = RunAnalysis(run_dir, None, World(threads=1), torch.float64)
    # global model on the centralized sample
    model = run.load(os.path.join(run_dir, "final_model.pt"))
    central = run.central_sample(3, 50, 0)
    assert sum(len(y) for _, y in central) == 150
    H = exact_hessian(model, central)
    ev = torch.linalg.eigvalsh(H)
    assert abs(res["global"]["lambda_max"] - float(ev[ev.abs().argmax()])) < 1e-6 * float(ev.abs().max())
    assert res["global"]["samples"] == 150 and res["global"]["data"] == "central"
    # H_N, H_D of the saved client models on each client's own data
    m = res["matching"]
    assert m["clients"] == saved_clients(run_dir, 2) and len(m["clients"]) == 3
    assert (m["model"], m["data"], m["diagonal"], m["pairs"]) == ("client", "client", "true", "distinct")
    diags = []
    for cid in m["clients"]:
        model = run.load(os.path.join(run_dir, "client_models", "round_000002", f"client_{cid:06d}.pt"))
        c = run.data.client(cid)
        diags.append(torch.diag(exact_hessian(model, [(c.x.double(), c.y)])))
    hn, hd = hessian_matching(diags)
    assert abs(m["H_N"] - hn) < 1e-9 * max(1.0, hn) and abs(m["H_D"] - hd) < 1e-9
    assert 0 < hd < 1 and hn > 0


def test_command_on_two_ranks_equals_one(run_dir, tmp_path):
    one, two = str(tmp_path / "one.json"), str(tmp_path / "two.json")
    extra = ["--diagonal", "layerwise", "--matching-data", "central", "--pairs", "all", "--iters", "40"]
    assert main([run_dir, *ARGS, *extra, "--out", one]) == 0
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "fedhpc.analysis.hessian", run_dir, *ARGS,
                        *extra, "--out", two], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = json.load(open(one)), json.load(open(two))
    assert b["ranks"] == 2 and a["ranks"] == 1
    for section, key in (("global", "lambda_max"), ("global", "trace"), ("matching", "H_N"), ("matching", "H_D")):
        assert abs(a[section][key] - b[section][key]) <= 1e-9 * max(1.0, abs(a[section][key])), key
    assert a["matching"]["data"] == "central" and a["matching"]["diagonal"] == "layerwise"


def test_command_errors_name_the_fix(tmp_path, run_dir):
    assert main([str(tmp_path), "--threads", "1"]) == 2  # no config.yaml
    assert main([run_dir, "--threads", "1", "--round", "1", "--skip-global", "--batches", "1"]) == 2  # nothing saved at round 1


# ----------------------------------------------------------------------------- bad input: each a reviewer's case

def _truncate(path):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])


QUICK = ["--threads", "1", "--batches", "1", "--iters", "3", "--trace-iters", "2", "--diag-samples", "2"]


def test_truncated_model_files_are_named_before_any_hessian_work(run_dir, tmp_path, capsys, monkeypatch):
    import shutil

    import fedhpc.analysis.hessian as hessian

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    # counts Hessian-vector products: a file found broken only after the work would show some
    hvps = []
    monkeypatch.setattr(hessian.Objective, "hvp", lambda self, v: hvps.append(1) or torch.zeros(self.numel,
                                                                                                 dtype=torch.float64))
    _truncate(copy / "final_model.pt")
    assert main([str(copy), *QUICK]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {copy / 'final_model.pt'} cannot be loaded") and "Traceback" not in err
    shutil.copy(os.path.join(run_dir, "final_model.pt"), copy / "final_model.pt")

    client = copy / "client_models" / "round_000002" / f"client_{saved_clients(run_dir, 2)[-1]:06d}.pt"
    _truncate(client)
    assert main([str(copy), *QUICK]) == 2
    assert capsys.readouterr().err.startswith(f"error: {client} cannot be loaded")
    assert hvps == [] and not (copy / "hessian.json").exists()


def test_a_truncated_client_model_on_one_rank_stops_both(run_dir, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    client = copy / "client_models" / "round_000002" / f"client_{saved_clients(run_dir, 2)[1]:06d}.pt"
    _truncate(client)  # the second client is rank 1's alone
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "fedhpc.analysis.hessian", str(copy), *QUICK,
                        "--skip-global"], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"error: {client} cannot be loaded" in p.stderr and "Traceback" not in p.stderr


def test_bad_clients_and_unwritable_out_are_refused_before_the_analysis(run_dir, tmp_path, capsys, monkeypatch):
    import fedhpc.analysis.hessian as hessian

    def analyse(*a):
        raise AssertionError("the analysis ran before the arguments were checked")

    monkeypatch.setattr(hessian, "analyse", analyse)
    for clients in ("abc", "1,x", "-1", ","):
        assert main([run_dir, *QUICK, "--clients", clients]) == 2
        assert capsys.readouterr().err == (f"error: --clients takes comma-separated client ids (integers >= 0, e.g. "
                                           f"--clients 0,3,7), got {clients!r}\n")
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main([run_dir, *QUICK, "--out", str(afile / "h.json")]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot write the result to {afile / 'h.json'} (")
    assert main([run_dir, *QUICK, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --out {tmp_path} is a folder; pass a file name")


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def test_hvps_of_an_lstm_run_its_forward_without_cudnn_on_cuda(monkeypatch):
    """cuDNN's RNN has no double backward (and no backward in eval mode): on CUDA the HVP's forward
    must run with cuDNN off. No GPU here: the helper's device check is made to answer "CUDA"
    (monkeypatch), the LSTM sees cuDNN off in every HVP forward, and H v is unchanged and equals
    the exact Hessian. The CUDA kernels themselves are not run by this test."""
    import fedhpc.models.double_backward as db

    torch.manual_seed(0)
    model = LSTMClassifier().double().eval()
    x, y = torch.randn(12, 5, 3, dtype=torch.float64), torch.randint(0, 3, (12,))
    batches = [(x[:7], y[:7]), (x[7:], y[7:])]
    H = exact_hessian(model, batches)
    seen = []
    model.rnn.register_forward_pre_hook(lambda mod, inp: seen.append(torch.backends.cudnn.enabled))
    obj = Objective(model, batches, 12)
    v = torch.randn(obj.numel, dtype=torch.float64)
    on_cpu = obj.hvp(v)
    assert seen == [True, True]
    seen.clear()
    monkeypatch.setattr(db, "_on_cuda", lambda device: True)
    on_cuda = obj.hvp(v)
    assert seen == [False, False] and torch.backends.cudnn.enabled is True
    assert torch.equal(on_cpu, on_cuda)
    assert torch.allclose(on_cpu, H @ v, atol=1e-12)


# ----------------------------------------------------------------------------- next-character data

class EmbedLinear(nn.Module):
    """The shape of lstm_char's problem without its cost: integer ids (B, T) -> logits (B, T, V)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(5, 2)
        self.head = nn.Linear(2, 5)

    def forward(self, ids):
        return self.head(torch.tanh(self.embedding(ids)))


def test_next_char_objective_is_the_token_mean_training_minimises():
    """Loss, H v, lambda_max and trace of the mean CE over every target position (training's
    ``task_loss``), not over sequences: with T = 6 positions the sum per sequence would be 6 times it."""
    from fedhpc.algorithms.base import task_loss

    torch.manual_seed(8)
    model = EmbedLinear().double().eval()
    x, y = torch.randint(0, 5, (9, 6)), torch.randint(0, 5, (9, 6))
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]  # uneven batches
    H = exact_hessian(model, batches)
    obj = Objective(model, batches, 9)
    assert obj.numel == H.shape[0] == 25
    with torch.no_grad():
        assert abs(obj.loss() - float(F.cross_entropy(model(x).reshape(-1, 5), y.reshape(-1)))) < 1e-12
        assert abs(obj.loss() - float(task_loss(model(x), y))) < 1e-12  # what a training step minimises
    v = torch.randn(25, dtype=torch.float64)
    assert torch.allclose(obj.hvp(v), H @ v, atol=1e-12)
    ev = torch.linalg.eigvalsh(H)
    top = float(ev[ev.abs().argmax()])
    eig, _, _ = top_eigenvalue(obj, iters=2000, tol=1e-13, seed=1)
    assert abs(eig - top) < 1e-8 * abs(top)
    assert abs(float(hessian_diagonal(obj, method="exact").sum()) - float(torch.trace(H))) < 1e-12
    est, n = hutchinson_trace(obj, iters=50, tol=0.0, seed=2)
    gen = torch.Generator().manual_seed(derive_seed(2, "hutchinson"))
    zs = torch.stack([rademacher(25, gen) for _ in range(n)])
    assert abs(est - float(((zs @ H) * zs).sum(1).mean())) < 1e-10


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """One round of FedAvg on a tiny TFF Shakespeare (next_char, 8 positions) with a small lstm_char."""
    pytest.importorskip("h5py")
    from test_formats import write_tff_shakespeare

    from fedhpc.config import parse_args
    from fedhpc.engine import Engine

    root = tmp_path_factory.mktemp("hess_text")
    write_tff_shakespeare(str(root / "data" / "shakespeare"))
    out = str(root / "run")
    argv = ["--algo", "fedavg", "--dataset", "shakespeare", "--data-dir", str(root / "data"), "--model", "lstm_char",
            "--model-opt", "embed_dim=2", "--model-opt", "hidden=3", "--model-opt", "num_layers=1",
            "--data-opt", "seq_len=8", "--partition", "natural", "--num-clients", "3", "--clients-per-round", "3",
            "--rounds", "1", "--local-epochs", "1", "--batch-size", "4", "--lr", "0.5", "--seed", "1",
            "--threads", "1", "--quiet", "--no-tensorboard", "--out", out]
    Engine(*parse_args(argv), World(threads=1)).run()
    return out


def test_command_on_next_char_data_against_exact_hessian(text_run, tmp_path):
    """lstm_char on Shakespeare: character ids reach the embedding as integers (they were cast to the
    analysis' float dtype), and loss and lambda_max are those of the token-mean CE training uses."""
    out = str(tmp_path / "h.json")
    assert main([text_run, "--dtype", "float64", "--batches", "2", "--batch-size", "5", "--iters", "2000",
                 "--tol", "1e-13", "--trace-iters", "2", "--skip-matching", "--threads", "1", "--out", out]) == 0
    res = json.load(open(out))["global"]
    run = RunAnalysis(text_run, None, World(threads=1), torch.float64)
    model = run.load(os.path.join(text_run, "final_model.pt"))
    central = run.central_sample(2, 5, 0)
    assert all(not x.is_floating_point() for x, _ in central) and central[0][1].dim() == 2
    n = sum(len(y) for _, y in central)
    assert res["samples"] == n
    x, y = torch.cat([b[0] for b in central]), torch.cat([b[1] for b in central])
    with torch.no_grad():
        logits = model(x)
    assert abs(res["loss"] - float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))) < 1e-10
    ev = torch.linalg.eigvalsh(exact_hessian(model, central))
    assert abs(res["lambda_max"] - float(ev[ev.abs().argmax()])) < 1e-6 * float(ev.abs().max())


def test_a_run_without_a_global_model_is_measured_at_its_client_models_only(tmp_path, capsys):
    """FD trains no global model, so its final_model.pt is the untrained initial one: lambda_max,
    the trace or H_k at it are refused, naming the ways out; its saved client models are measured."""
    from fedhpc.config import parse_args
    from fedhpc.engine import Engine

    out = str(tmp_path / "fd")
    Engine(*parse_args(["--algo", "fd", "--dataset", "digits", "--model", "mlp", "--model-opt", "hidden=2",
                        "--num-clients", "3", "--clients-per-round", "3", "--rounds", "1", "--seed", "2",
                        "--threads", "1", "--quiet", "--no-tensorboard", "--save-client-models", "last",
                        "--out", out]), World(threads=1)).run()
    want = ("error: fd trains no global model: the run's final_model.pt is its untrained initial model. Measure "
            "the saved client models alone (--skip-global, --matching-model client) or name a model file with "
            "--model\n")
    for extra in ([], ["--skip-matching"], ["--skip-global", "--matching-model", "global"]):
        assert main([out, *QUICK, *extra]) == 2
        assert capsys.readouterr().err == want
    assert not os.path.exists(os.path.join(out, "hessian.json"))
    assert main([out, *QUICK, "--skip-global"]) == 0
    result = json.load(open(os.path.join(out, "hessian.json")))
    assert "global" not in result and result["matching"]["clients"] == [0, 1, 2]
