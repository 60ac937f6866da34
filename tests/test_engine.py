"""In-process checks of the round loop against independent computations."""

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedhpc.algorithms.base import derive_seed
from fedhpc.config import RunConfig
from fedhpc.engine import Engine, assign_clients, sample_clients
from fedhpc.errors import NonFiniteLossError
from fedhpc.models import build_model
from fedhpc.round import ClientContext, RoundInfo
from fedhpc.world import World


def make_engine(algo_options=None, device="cpu", **kw):
    cfg = RunConfig(**{"quiet": True, "tensorboard": False, "model": "mlp", **kw})
    cfg.validate()
    from fedhpc.algorithms import ALGORITHMS, load_algorithm_modules
    from fedhpc.config import build_options
    load_algorithm_modules()
    opts = build_options(ALGORITHMS.get(cfg.algo).Options, algo_options or {}, cfg.algo)
    # CPU: these tests compare with hand computations on CPU tensors (the GPU has its own below)
    return Engine(cfg, opts, None, World(device, threads=1))


def test_fedavg_one_client_full_participation_is_centralized_sgd():
    rounds, epochs, lr, decay, bs, seed = 3, 2, 0.05, 0.8, 16, 7
    eng = make_engine(num_clients=1, clients_per_round=1, rounds=rounds, local_epochs=epochs,
                      lr=lr, lr_decay=decay, batch_size=bs, seed=seed, client_test_fraction=0.0)
    data = eng.data.client(0)
    eng.run()

    # Independent loop: plain SGD over the same data, the documented batch order, lr decay per round.
    torch.manual_seed(derive_seed(seed, "init"))
    model = build_model("mlp", eng.data.input_shape, 10)
    for t in range(rounds):
        opt = torch.optim.SGD(model.parameters(), lr=lr * decay ** t)
        for e in range(epochs):
            g = torch.Generator().manual_seed(derive_seed(seed, "batches", t, 0, e))
            perm = torch.randperm(data.num_train, generator=g)
            for s in range(0, data.num_train, bs):
                idx = perm[s:s + bs]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
                opt.step()
    central = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    fed = eng.global_state[: central.numel()]
    assert torch.allclose(fed, central, atol=1e-6, rtol=0), float((fed - central).abs().max())
    # and training did something
    torch.manual_seed(derive_seed(seed, "init"))
    init = torch.cat([p.detach().reshape(-1) for p in build_model("mlp", eng.data.input_shape, 10).parameters()])
    assert (central - init).abs().max() > 1e-3


def test_fedavg_aggregate_is_weighted_mean_of_client_models():
    eng = make_engine(num_clients=6, clients_per_round=3, rounds=1, seed=3, lr=0.1)
    start = eng.global_state.clone()
    sampled = sample_clients(3, 0, 6, 3)
    # Train each sampled client by hand from the same start through the algorithm's own hook.
    from fedhpc.algorithms import ClientContext, RoundInfo
    rnd = RoundInfo(0, sampled, sampled, 0.1)
    eng.algo.global_state = start
    models, weights = [], []
    for cid in sampled:
        torch.manual_seed(derive_seed(3, "client", 0, cid))
        eng.flat.load_(start)
        ctx = ClientContext(eng.algo, cid, eng.data.client(cid), rnd)
        eng.algo.local_update(eng.model, ctx)
        models.append(eng.flat.flat.clone().double())
        weights.append(eng.data.client(cid).num_train)
    expected = sum(w * m for w, m in zip(weights, models)) / sum(weights)
    eng.flat.load_(start)
    eng.global_state = start.clone()
    eng.run_round(0)
    assert torch.allclose(eng.global_state.double(), expected, atol=1e-6)


def test_fedavgm_steps_the_parameters_and_averages_batchnorm_statistics():
    """FedAvgM's server step, two rounds by hand: v <- beta v + (g - avg), g <- g - eta v on the
    parameters; BatchNorm's running statistics take the clients' plain average (a step past it
    took the running variance below zero and the test loss to NaN)."""
    eta, beta = 1.5, 0.9
    eng = make_engine({"server_lr": eta, "server_momentum": beta}, model="cnn", num_clients=4,
                      clients_per_round=2, rounds=2, seed=2, model_options={"norm": "batch", "width": 4})
    names = {e.name: e for e in eng.flat.entries}
    assert any(n.endswith("running_var") for n in names)
    param = torch.zeros(eng.flat.numel, dtype=torch.bool)
    for e in eng.flat.entries:
        param[e.offset:e.offset + e.numel] = e.is_param
    gen = torch.Generator().manual_seed(0)
    g = eng.global_state.double()
    v = torch.zeros_like(g)
    for t in range(2):
        # averages whose running variances the step would push below zero
        avg = g + 0.5 * torch.randn(g.shape, dtype=torch.float64, generator=gen)
        for e in eng.flat.entries:
            if e.name.endswith("running_var"):
                avg[e.offset:e.offset + e.numel] = 0.05
        weight = 7.0
        new = eng.algo.aggregate(g, {"params": avg * weight}, weight, None)
        v = beta * v + (g - avg)
        expected = torch.where(param, g - eta * v, avg)
        assert torch.allclose(new.double(), expected, atol=1e-12, rtol=0)
        g = new.double()
    for e in eng.flat.entries:
        if e.name.endswith("running_var"):
            assert bool((g[e.offset:e.offset + e.numel] > 0).all())


def test_fedprox_mu_zero_equals_fedavg_and_mu_positive_differs():
    common = dict(num_clients=6, clients_per_round=3, rounds=3, seed=11, lr=0.1, local_epochs=2)
    fedavg = make_engine(algo="fedavg", **common); fedavg.run()
    prox0 = make_engine(algo="fedprox", algo_options={"mu": 0.0}, **common); prox0.run()
    prox1 = make_engine(algo="fedprox", algo_options={"mu": 1.0}, **common); prox1.run()
    assert torch.equal(fedavg.global_state, prox0.global_state)
    assert (fedavg.global_state - prox1.global_state).abs().max() > 1e-4


def test_fedprox_gradient_of_proximal_term_is_closed_form():
    from fedhpc.algorithms.fedprox import proximal_term
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    anchor = [p.detach() + 0.1 * torch.randn_like(p) for p in model.parameters()]
    mu = 0.37
    proximal_term(model, anchor, mu).backward()
    for p, a in zip(model.parameters(), anchor):
        assert torch.allclose(p.grad, mu * (p.detach() - a), atol=1e-6)


def test_sampling_is_seeded_and_rank_independent():
    a = [sample_clients(5, t, 100, 10) for t in range(20)]
    b = [sample_clients(5, t, 100, 10) for t in range(20)]
    assert a == b
    assert all(len(set(s)) == 10 and all(0 <= c < 100 for c in s) for s in a)
    assert len({tuple(s) for s in a}) > 15  # rounds differ
    assert sample_clients(6, 0, 100, 10) != a[0]
    # uniform: every client is sampled about equally often over many rounds
    counts = np.bincount(np.concatenate([sample_clients(1, t, 20, 5) for t in range(4000)]), minlength=20)
    assert counts.min() > 0.9 * 1000 and counts.max() < 1.1 * 1000


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_assignment_covers_sampled_and_balances_load(world):
    rng = np.random.default_rng(0)
    sizes = rng.integers(5, 500, size=200)
    sampled = sample_clients(0, 0, 200, 40)
    a = assign_clients(sampled, sizes, world)
    assert sorted(a) == sampled and set(a.values()) <= set(range(world))
    loads = [sum(sizes[c] for c in a if a[c] == r) for r in range(world)]
    # greedy largest-first: no rank exceeds the ideal share by more than one client
    assert max(loads) - sum(loads) / world <= max(sizes[c] for c in sampled)


@pytest.mark.parametrize("clients_at_once", [1, 2])
def test_nan_loss_stops_with_a_clear_message(clients_at_once):
    """Sequential clients and a batched group (whose losses are read in one sync) alike."""
    eng = make_engine(num_clients=4, clients_per_round=2, rounds=3, lr=1e30, clients_at_once=clients_at_once)
    with pytest.raises(NonFiniteLossError) as e:
        eng.run()
    msg = str(e.value)
    assert "NaN or infinite" in msg and "--lr" in msg and "round 1" in msg
    assert "client(s) [" in msg and msg.split("client(s) [")[1].split("]")[0]  # names them


@pytest.mark.parametrize("clients_at_once", [1, 4])
def test_a_nan_loss_is_pinned_on_its_own_client(clients_at_once, monkeypatch):
    """A client whose inputs are NaN is the one named, whether it trained alone or in a batched group
    whose losses were read together."""
    eng = make_engine(num_clients=8, clients_per_round=4, rounds=1, clients_at_once=clients_at_once)
    bad = sample_clients(eng.cfg.seed, 0, 8, 4)[2]
    original = eng.data.client

    def client(cid):
        c = original(cid)
        if cid == bad:
            c.x = torch.full(c.x.shape, float("nan"))
        return c

    monkeypatch.setattr(eng.data, "client", client)
    with pytest.raises(NonFiniteLossError, match=rf"client\(s\) \[{bad}\] "):
        eng.run_round(0)


def test_a_groups_clients_move_to_the_device_together():
    """ClientData.all_training_on: every client's training rows and labels, in order, as views of two
    tensors moved at once ('meta' stands in for a GPU: shapes and order; on the CPU nothing moves)."""
    eng = make_engine(num_clients=6, clients_per_round=3, rounds=1)
    from fedhpc.data.base import ClientData
    clients = [eng.data.client(c) for c in (4, 0, 5)]
    moved = ClientData.all_training_on(clients, torch.device("meta"))
    assert [m.cid for m in moved] == [4, 0, 5]
    for c, m in zip(clients, moved):
        assert m.x.device.type == "meta" and m.x.shape == c.x.shape and m.y.shape == c.y.shape
        assert m.x_test is c.x_test  # the local test split stays on the host
    assert moved[1].x.data_ptr() == moved[0].x.data_ptr() + moved[0].x.nbytes  # one tensor, in order
    on_cpu = ClientData.all_training_on(clients, torch.device("cpu"))
    assert all(a.x is c.x for a, c in zip(on_cpu, clients))


class CountOps(TorchDispatchMode):
    """The names of the operators dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class CountItems(TorchDispatchMode):
    """Counts the operators that copy a device scalar to the host (``item``, ``float(t)``): on a GPU
    each waits for everything queued before it."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket is torch.ops.aten._local_scalar_dense
        return func(*args, **(kwargs or {}))


def test_a_batched_group_reads_its_clients_losses_in_one_sync(monkeypatch):
    """The non-finite guard reads every client's training loss on the host: one read a client in the
    sequential loop (its recorded steps in one ``tolist``), one for a whole batched group; the round's
    other reads (its metrics) do not grow with the clients, whose per-client sums (samples, weights,
    times) add up on the host."""
    tolists = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: tolists.append(1) or tolist(t))

    def reads(clients, at_once):
        eng = make_engine(num_clients=8, clients_per_round=clients, rounds=2, clients_at_once=at_once)
        eng.run_round(0)
        tolists.clear()
        with CountItems() as count:
            eng.run_round(1)
        return count.n + len(tolists)

    assert reads(6, 6) == reads(2, 2)  # one group each
    assert reads(6, 1) - reads(2, 1) == 4  # one a client
    assert reads(6, 6) == reads(6, 1) - 5  # the group's six clients in one read


def test_recorded_steps_add_up_as_float64_steps_on_the_device():
    """``record`` keeps each step's loss and adds them when the sum is read: the same float64 sum as
    ``loss_sum.add_(loss, alpha=n)`` step by step (each n * loss exact), also with a method's own
    in-place add in between (Ditto's guard) and a NaN step; no operator runs at a step."""
    eng = make_engine(num_clients=4, clients_per_round=2, rounds=1)
    rnd = RoundInfo(0, [0, 1], [0, 1], 0.1)
    g = torch.Generator().manual_seed(0)
    # losses from 1e-9 to 3e3: their float64 sum rounds, so its order shows in the last bits
    losses = torch.exp(torch.rand(200, generator=g, dtype=torch.float64) * 29 - 21).float()
    sizes = torch.randint(1, 64, (200,), generator=g).tolist()
    want = torch.zeros((), dtype=torch.float64)
    ctx = ClientContext(eng.algo, 0, eng.data.client(0), rnd)
    for i, (loss, n) in enumerate(zip(losses, sizes)):
        want.add_(loss, alpha=n)
        step_loss = loss.clone().requires_grad_()
        with CountOps() as ops:
            ctx.record(step_loss, n)
        assert ops.names <= {"detach"}, ops.names  # nothing added on the device at a step
        if i == 99:  # a method reading and adding in between
            ctx.loss_sum.add_(torch.tensor(0.0, dtype=torch.float64))
            want.add_(torch.tensor(0.0, dtype=torch.float64))
    assert ctx.loss_total() == float(want) and ctx.samples == sum(sizes)
    assert float(ctx.loss_sum) == float(want)
    bad = ClientContext(eng.algo, 1, eng.data.client(1), rnd)
    bad.record(torch.tensor(1.0), 4)
    bad.record(torch.tensor(float("nan")), 4)
    bad.record(torch.tensor(1.0), 4)
    assert math.isnan(bad.loss_total())


def test_flat_model_round_trip_and_state_dict():
    eng = make_engine(num_clients=4, clients_per_round=2, rounds=1)
    v = torch.randn(eng.flat.numel)
    eng.flat.load_(v)
    got = torch.cat([p.detach().reshape(-1) for p in eng.model.parameters()])
    assert torch.equal(got, v[: got.numel()])
    sd = eng.flat.state_dict_from(v)
    assert set(sd) == set(eng.model.state_dict())
    fresh = build_model("mlp", eng.data.input_shape, 10)
    fresh.load_state_dict(sd)
    x = torch.randn(3, 1, 8, 8)
    assert torch.allclose(fresh(x), eng.model(x))


def test_local_test_accuracy_is_every_clients_model_on_its_own_split():
    """Brute force: loop over all clients (not only the sampled ones), evaluate the global model
    on each local test split, weight by split size; also the spread across clients."""
    eng = make_engine(num_clients=7, clients_per_round=3, rounds=2, seed=4, partition="dirichlet:0.5",
                      client_test_fraction=0.3)
    final = eng.run()
    eng.flat.load_(eng.global_state)
    eng.model.eval()
    correct, count, accs = 0, 0, []
    with torch.no_grad():
        for cid in range(7):
            c = eng.data.client(cid)
            if c.num_test == 0:
                continue
            hits = int((eng.model(c.x_test).argmax(-1) == c.y_test).sum())
            correct, count = correct + hits, count + c.num_test
            accs.append(hits / c.num_test)
    assert count > 0 and len(accs) == 7
    assert final["local_test_accuracy"] == pytest.approx(correct / count, abs=1e-12)
    assert final["local_test_accuracy_mean"] == pytest.approx(np.mean(accs), abs=1e-12)
    assert final["local_test_accuracy_std"] == pytest.approx(np.std(accs), abs=1e-12)
    assert final["local_test_accuracy_worst10"] == pytest.approx(min(accs), abs=1e-12)
    assert "local_test_accuracy_global_model" not in final  # every client uses the global model
    no_split = make_engine(num_clients=4, clients_per_round=2, rounds=1, client_test_fraction=0.0).run()
    assert "local_test_accuracy" not in no_split


def test_cold_start_clients_never_train_and_are_evaluated_after_adaptation():
    eng = make_engine(num_clients=10, clients_per_round=3, rounds=3, seed=6, partition="dirichlet:1.0",
                      cold_start_fraction=0.3, client_test_fraction=0.3)
    cold = eng.cold_start
    assert len(cold) == 3 and set(cold).isdisjoint(eng.training_clients)
    trained = []
    local_update = eng.algo.local_update
    eng.algo.local_update = lambda model, ctx: (trained.append(ctx.cid), local_update(model, ctx))[1]

    def adapt(model, ctx):  # one plain SGD step on the client's first batch: something to check
        x, y = next(iter(ctx.batches(0)))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
                p.grad = None

    eng.algo.adapt = adapt
    final = eng.run()
    assert trained and not set(trained) & set(cold)

    # brute force, client by client
    def accuracy(state, cid, adapt_first):
        eng.flat.load_(state)
        if adapt_first:
            from fedhpc.algorithms.base import seed_torch
            seed_torch(derive_seed(6, "adapt", cid))
            eng.model.train()
            adapt(eng.model, ClientContext(eng.algo, cid, eng.data.client(cid), RoundInfo(3, [], [], eng.cfg.lr)))
        eng.model.eval()
        c = eng.data.client(cid)
        with torch.no_grad():
            return int((eng.model(c.x_test).argmax(-1) == c.y_test).sum()), c.num_test

    from fedhpc.algorithms import ClientContext, RoundInfo
    before = [accuracy(eng.global_state, c, False) for c in cold]
    after = [accuracy(eng.global_state, c, True) for c in cold]
    assert final["cold_start_accuracy_global_model"] == pytest.approx(sum(h for h, _ in before) / sum(n for _, n in before))
    assert final["cold_start_accuracy"] == pytest.approx(sum(h for h, _ in after) / sum(n for _, n in after))
    assert final["cold_start_accuracy"] != final["cold_start_accuracy_global_model"]  # adapt did run
    assert final["participation_gap"] == pytest.approx(
        final["local_test_accuracy_mean"] - np.mean([h / n for h, n in after]))


def test_per_label_accuracy_is_a_brute_force_count_over_the_test_set():
    eng = make_engine(num_clients=4, clients_per_round=2, rounds=2, seed=5, per_label_accuracy=True)
    final = eng.run()
    # Independent count: the final global model, sample by sample over the whole test set.
    eng.flat.load_(eng.global_state)
    eng.model.eval()
    x, y = eng.data.test_slice(0, eng.data.num_test())
    with torch.no_grad():
        pred = eng.model(eng.data.transform(x, False, None)).argmax(-1)
    hits = {c: [0, 0] for c in range(eng.data.num_classes)}
    for p, t in zip(pred.tolist(), y.tolist()):
        hits[t][0] += int(p == t)
        hits[t][1] += 1
    for c, (right, seen) in hits.items():
        assert final[f"test_accuracy_label{c}"] == pytest.approx(right / seen, abs=1e-12)
    assert 0 < final["test_accuracy"] < 1
    # off by default: no per-label keys
    plain = make_engine(num_clients=4, clients_per_round=2, rounds=1, seed=5).run()
    assert not any(k.startswith("test_accuracy_label") for k in plain)


class ShardWorld:
    """Rank ``rank`` of ``size`` for one evaluation; keeps the sums it would all-reduce."""

    def __init__(self, rank, size):
        self.rank, self.size, self.device, self.sums = rank, size, torch.device("cpu"), None

    def all_reduce_sum_(self, tensor):
        self.sums = tensor.clone()


@pytest.mark.parametrize("size", [2, 3, 5])
def test_the_test_sums_do_not_depend_on_the_number_of_ranks(size):
    """Each rank evaluates its shard of the global test set: the shards' sums must add up to one
    rank's sums exactly (with float32 sums per batch over rank-cut batches, the test loss moved
    in the 7th digit between 1 and 2 ranks; with one float64 loss sum per rank, in its last bits).
    The sums are (loss, correct, count, per label correct and count), then each batch's loss."""
    eng = make_engine(num_clients=4, clients_per_round=2, rounds=1, seed=5, eval_batch_size=40,
                      per_label_accuracy=True)
    eng.run()

    def sums(rank, size):
        eng.world = ShardWorld(rank, size)
        with torch.no_grad():  # as evaluate() calls it
            eng._evaluate_global(eng.global_state)
        return eng.world.sums

    whole = sums(0, 1)
    assert torch.equal(sum(sums(r, size) for r in range(size)), whole)
    assert whole[2] == eng.data.num_test()
    width, batches = 3 + 2 * eng.data.num_classes, -(-eng.data.num_test() // 40)
    assert whole.numel() == width + batches and whole[0] == 0  # the loss is in the batches' slots
    eng.world = ShardWorld(0, 1)
    with torch.no_grad():
        logged = eng._evaluate_global(eng.global_state)["test_loss"]
    assert logged * eng.data.num_test() == pytest.approx(float(whole[width:].sum()), rel=1e-12)
    eng.flat.load_(eng.global_state)
    eng.model.eval()
    x, y = eng.data.test_slice(0, eng.data.num_test())
    with torch.no_grad():  # independent: every sample's loss in float64, in one sum
        each = torch.nn.functional.cross_entropy(eng.model(eng.data.transform(x, False, None)).double(), y,
                                                 reduction="none")
    assert float(whole[width:].sum()) == pytest.approx(float(each.sum()), rel=1e-6)


def test_full_participation_with_cold_start_clients_samples_every_training_client():
    eng = make_engine(num_clients=10, clients_per_round=10, rounds=2, seed=1, cold_start_fraction=0.2)
    assert eng.cfg.clients_per_round == 8 == len(eng.training_clients)
    seen = []
    local_update = eng.algo.local_update
    eng.algo.local_update = lambda model, ctx: (seen.append((ctx.round.index, ctx.cid)), local_update(model, ctx))[1]
    eng.run()
    for t in range(2):
        assert sorted(c for r, c in seen if r == t) == eng.training_clients
    # partial participation above the training pool is still refused
    from fedhpc.errors import ConfigError
    with pytest.raises(ConfigError, match="cold-start"):
        make_engine(num_clients=10, clients_per_round=9, rounds=1, cold_start_fraction=0.2)


def test_nesterov_momentum_is_the_hand_written_update():
    """--nesterov: v <- mu v + g (+ wd p); p <- p - lr (g + mu v), by hand on one client's steps."""
    lr, mu, wd, bs, seed = 0.05, 0.9, 1e-3, 16, 3
    eng = make_engine(num_clients=1, clients_per_round=1, rounds=1, lr=lr, momentum=mu, nesterov=True,
                      weight_decay=wd, batch_size=bs, seed=seed, client_test_fraction=0.0)
    data = eng.data.client(0)
    eng.run()
    torch.manual_seed(derive_seed(seed, "init"))
    model = build_model("mlp", eng.data.input_shape, 10)
    params = list(model.parameters())
    bufs = [torch.zeros_like(p) for p in params]
    g = torch.Generator().manual_seed(derive_seed(seed, "batches", 0, 0, 0))
    perm = torch.randperm(data.num_train, generator=g)
    for s in range(0, data.num_train, bs):
        idx = perm[s:s + bs]
        grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(data.x[idx]), data.y[idx]), params)
        with torch.no_grad():
            for p, gr, v in zip(params, grads, bufs):
                d = gr + wd * p
                v.mul_(mu).add_(d)
                p.sub_(lr * (d + mu * v))
    hand = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.allclose(eng.global_state[: hand.numel()], hand, atol=1e-6, rtol=0)
    # and it is not plain momentum
    plain = make_engine(num_clients=1, clients_per_round=1, rounds=1, lr=lr, momentum=mu, weight_decay=wd,
                        batch_size=bs, seed=seed, client_test_fraction=0.0)
    plain.run()
    assert (plain.global_state - eng.global_state).abs().max() > 1e-4
    from fedhpc.errors import ConfigError
    with pytest.raises(ConfigError, match="nesterov"):
        make_engine(nesterov=True, momentum=0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device machine)")
@pytest.mark.parametrize("algo,options,model", [("fedavg", None, "cnn"), ("fedmix", {"lam": 0.2}, "mlp"),
                                                ("fedprox", {"mu": 0.1}, "cnn")])
def test_a_gpu_run_equals_the_cpu_run(algo, options, model):
    """The engine on a GPU (deterministic numerics: no TF32) computes the CPU's model.

    One round: CPU and GPU kernels sum in different orders, and with SGD momentum the rounding
    difference grows by about 10x a round (measured on an H100: 6.6e-4 after three rounds of
    the digits CNN), so later rounds would test the dynamics, not the engine."""
    kw = dict(algo=algo, model=model, num_clients=6, clients_per_round=3, rounds=1, seed=5, lr=0.05, batch_size=16,
              momentum=0.9, partition="dirichlet:0.5")
    runs = {}
    for device in ("cpu", "cuda"):
        eng = make_engine(options, device=device, **kw)
        start = eng.global_state.detach().cpu().clone()
        final = eng.run()
        assert eng.global_state.device.type == device
        # the batched pass over the clients' splits ran on the device too (its counts index_add_ there)
        assert 0 <= final["local_test_accuracy"] <= 1 and 0 <= final["test_accuracy"] <= 1
        runs[device] = eng.global_state.detach().cpu()
    diff = float((runs["cpu"] - runs["cuda"]).abs().max())
    assert diff <= 1e-4, diff
    assert float((runs["cpu"] - start).abs().max()) > 1e-2  # the runs trained


def test_the_training_loss_is_summed_per_client_in_client_order():
    """Each sampled client's loss sum has its own slot of the round's buffer (one nonzero term per
    slot in the all-reduce, whatever the rank count) and the round's train_loss is their exact
    sum (fsum) over the samples: a running float64 sum per rank would move its last bits with
    the rank count."""
    import math

    from fedhpc.algorithms import ClientContext, RoundInfo

    eng = make_engine(num_clients=6, clients_per_round=4, rounds=1, seed=4, lr=0.1)
    start = eng.global_state.clone()
    metrics = eng.run_round(0)
    slots = eng.round_buffer[eng.loss_offset:eng.loss_offset + 4].tolist()
    samples = float(eng.round_buffer[eng._slot("samples")])
    assert metrics["train_loss"] == math.fsum(slots) / samples
    # independent: each sampled client trained by hand through the algorithm's hook, in order
    sampled = sample_clients(4, 0, 6, 4)
    rnd = RoundInfo(0, sampled, sampled, 0.1)
    eng.algo.global_state = start
    for position, cid in enumerate(sampled):
        torch.manual_seed(derive_seed(4, "client", 0, cid))
        eng.flat.load_(start)
        ctx = ClientContext(eng.algo, cid, eng.data.client(cid), rnd)
        eng.algo.local_update(eng.model, ctx)
        assert slots[position] == float(ctx.loss_sum), position


def test_uploads_are_summed_exactly_not_in_float64_rank_order():
    """The engine adds the clients' uploads through ReproducibleSum: 2**60, 3 and -2**60 from
    three clients total 3 in any order and on any number of ranks, where a float64 running sum
    (what a rank used to keep) gives 0 in this order, and another value with the terms grouped
    over ranks otherwise."""
    eng = make_engine(num_clients=6, clients_per_round=4, rounds=1, seed=4, lr=0.1)
    (name, (_, spec)), = [(n, v) for n, v in eng.uploads.items() if v[1].bound is None][:1]
    sampled = sample_clients(4, 0, 6, 4)
    pattern = {sampled[0]: 2.0 ** 60, sampled[1]: 3.0, sampled[2]: -2.0 ** 60, sampled[3]: 0.5}
    seen = {}

    def upload(model, ctx):
        t = torch.zeros(spec.numel)
        t[0], t[1] = pattern[ctx.cid], -pattern[ctx.cid]
        return {name: t}

    def aggregate(global_state, totals, weight_total, rnd):
        seen.update(totals=totals[name].clone(), weight=weight_total)
        return global_state

    eng.algo.upload = upload
    eng.algo.client_weight = lambda ctx: 1.0
    eng.algo.aggregate = aggregate
    eng.run_round(0)
    assert seen["weight"] == 4.0
    assert seen["totals"][:2].tolist() == [3.5, -3.5]
    assert (2.0 ** 60 + 3.0) - 2.0 ** 60 + 0.5 == 0.5  # the plain running sum this replaces


def test_cumulative_batchnorm_is_refused_with_the_fix(monkeypatch):
    """BatchNorm with momentum=None averages over its own step counter, which is not federated."""
    from torch import nn

    from fedhpc.errors import ConfigError
    from fedhpc.flat import refuse_cumulative_batchnorm

    with pytest.raises(ConfigError, match=r"momentum=None \(1\).*0\.1"):
        refuse_cumulative_batchnorm(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None)))
    refuse_cumulative_batchnorm(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))  # the default momentum is fine

    # and the engine asks before it trains anything
    import fedhpc.engine as engine_module

    def cumulative_cnn(*args, **kwargs):
        model = build_model(*args, **kwargs)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = None
        return model

    monkeypatch.setattr(engine_module, "build_model", cumulative_cnn)
    cfg = RunConfig(model="cnn", model_options={"norm": "batch"}, rounds=1, quiet=True, tensorboard=False)
    with pytest.raises(ConfigError, match="momentum=None"):
        Engine(cfg, None, None, World(threads=1))
