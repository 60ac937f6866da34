"""Second-order analysis of FedAlign's study (Mendieta et al., CVPR 2022, Sec. 3.4, Table 1).

    python -m fedhpc.analysis.hessian RUN_DIR [options]          (also under mpiexec / srun / torchrun)

On a finished run it measures

* lambda_max: the top Hessian eigenvalue of the global model's loss, by power
  iteration on Hessian-vector products (Yao et al. 2018/2020, PyHessian's rule: random
  normal start, stop when the estimate changes by less than ``tol`` relatively, at most
  ``iters`` steps); power iteration finds the eigenvalue of largest magnitude;
* H_T: the Hessian trace, by Hutchinson's estimator E[z^T H z] with Rademacher z;
* H_N and H_D across clients (Eqs. 3-4): with d_k = Diag(H_k),
  H_N^{kj} = (||d_k|| - ||d_j||)^2 and H_D^{kj} = <d_k, d_j> / (||d_k|| ||d_j||),
  "averaged across all pairs of clients".

Readings chosen (each an option, and recorded in the output):

* The loss is the mean cross-entropy over a fixed sample (next-character data: over every
  target position of it, the loss training minimises), with the model in
  evaluation mode (BatchNorm's running statistics, no dropout), so a sample's loss
  does not depend on how samples are batched, and results do not depend on ranks.
* lambda_max and H_T use ``--batches`` batches of ``--batch-size`` drawn (seeded) from
  the centralized training set (the union of the clients' training parts), as the
  authors' scripts do (10 batches).
* H_k is the Hessian at client k's own model, saved at round ``--round`` by the run
  option ``--save-client-models`` (``--matching-model global``: at the global model
  instead, the out-of-distribution papers' reading), on client k's own training data
  (``--matching-data client``, default: the paper treats each client as a domain) or
  on the centralized sample (``central``: the authors' scripts).
* Diag(H) is the true diagonal (``--diagonal true``), estimated by Hutchinson's diagonal
  estimator E[z * Hz] (Bekas et al. 2007), or computed exactly with one HVP per
  parameter (``--diag-method exact``, small models). ``--diagonal layerwise`` is the
  authors' reading: one number per parameter tensor, z_l^T (H z)_l, i.e. an estimate of
  the trace of that tensor's diagonal block.
* Pairs: ``distinct`` (default: k < j) or ``all`` (the authors': every ordered pair,
  k = j included, which pulls H_N towards 0 and H_D towards 1).

Work is spread over ranks: the global model's HVPs data-parallel (batch b on rank
b mod size, float64 sums that do not depend on the split: fedhpc.reproducible_sum), the clients' diagonals client by client (the
i-th client on rank i mod size). Random vectors are seeded by (seed, what, client),
never by rank. Rank 0 writes ``RUN_DIR/hessian.json`` atomically.

Saved client models: ``OUT/client_models/round_<R>/client_<cid>.pt``, each a state
dict like ``final_model.pt`` (:func:`save_client_model`). The estimators themselves are
:mod:`fedhpc.analysis.hessian_estimators`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError, DataError, FedHPCError
from ..io import atomic_torch_save, atomic_write_json, probe_write
from ..seeding import derive_seed
from .hessian_estimators import (Objective, hessian_diagonal, hessian_matching, hutchinson_trace, layerwise,
                                 top_eigenvalue)



# --------------------------------------------------------------------------- saved client models

def client_models_dir(out: str, round_: int) -> str:
    return os.path.join(out, "client_models", f"round_{round_:06d}")


def save_client_model(out: str, round_: int, cid: int, state_dict: Dict[str, torch.Tensor]) -> str:
    """Write client ``cid``'s model after its local training in round ``round_`` (1-based), atomically."""
    path = os.path.join(client_models_dir(out, round_), f"client_{cid:06d}.pt")
    atomic_torch_save(state_dict, path)
    return path


def saved_rounds(out: str) -> List[int]:
    root = os.path.join(out, "client_models")
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for d in os.listdir(root) if (m := re.fullmatch(r"round_(\d+)", d)))


def saved_clients(out: str, round_: int) -> List[int]:
    d = client_models_dir(out, round_)
    if not os.path.isdir(d):
        return []
    return sorted(int(m.group(1)) for f in os.listdir(d) if (m := re.fullmatch(r"client_(\d+)\.pt", f)))


# --------------------------------------------------------------------------- a run's data and models

def batches_of(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    return [(x[s:s + batch_size], y[s:s + batch_size]) for s in range(0, y.shape[0], batch_size)]


class RunAnalysis:
    """A finished run's configuration, data and models, rebuilt from ``RUN_DIR``."""

    def __init__(self, run_dir: str, data_dir: Optional[str], world, dtype: torch.dtype = torch.float32):
        from ..registry import ALGORITHMS
        from ..config import parse_args
        from ..data import build_dataset
        from ..models import build_model

        path = os.path.join(run_dir, "config.yaml")
        if not os.path.exists(path):
            raise ConfigError(f"{run_dir} has no config.yaml: pass the --out folder of a fedhpc run")
        argv = ["--config", path, "--out", "", "--no-resume", "--save-client-models", ""]  # reads, never writes
        if data_dir:
            argv += ["--data-dir", data_dir]
        self.cfg, algo_options, data_options = parse_args(argv)
        self.run_dir, self.world, self.dtype = run_dir, world, dtype
        self.data = build_dataset(self.cfg, data_options)
        name = self.data.model_for(self.cfg.model)

        def make():
            m = build_model(name, self.data.model_input_shape(train=True), self.data.num_classes,
                            self.cfg.model_options)
            configure = getattr(ALGORITHMS.get(self.cfg.algo), "configure_model", None)
            if configure is not None:  # e.g. StochDepth's keep probabilities: evaluate what was trained
                configure(m, algo_options)
            return m.to(world.device, dtype).eval()

        self.model = make()

    def load(self, path: str) -> nn.Module:
        if not os.path.exists(path):
            raise DataError(f"missing model file {path}")
        # A file cut short (a full disk, a copy interrupted) or not a state dict at all surfaces as
        # torch's RuntimeError / pickle errors; a state dict of another model as load_state_dict's
        # RuntimeError. Either way the fix is the same: the file, not the command.
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise TypeError(f"it holds a {type(state).__name__}, not a state dict of tensors")
            self.model.load_state_dict({k: (v.to(self.dtype) if v.is_floating_point() else v)
                                        for k, v in state.items()})
        except Exception as e:
            problem = " ".join(str(e).split()).split(". ")[0][:300]  # torch's first sentence says it
            raise CheckpointError(
                f"{path} cannot be loaded as a model of this run ({type(e).__name__}: {problem}); it is truncated or "
                f"corrupt, or belongs to another run: copy it again from where the run wrote it, or rerun the "
                f"run (--save-client-models for client models)") from None
        return self.model

    def _prepare(self, x: torch.Tensor, y: torch.Tensor):
        dev = self.world.device
        x = self.data.transform(x.to(dev), False, None)
        # only real-valued inputs take the analysis' dtype: character ids (token_ids) stay integers
        # for the embedding, which refuses float indices
        return (x.to(self.dtype) if x.is_floating_point() else x), y.to(dev)

    def central_sample(self, batches: int, batch_size: int, seed: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``batches`` x ``batch_size`` samples of the centralized training set (every client's
        training part), drawn without replacement, seeded; the same batches on every rank."""
        sizes = [int(s) for s in self.data.client_sizes()]
        total = sum(sizes)
        want = min(total, batches * batch_size)
        gen = torch.Generator().manual_seed(derive_seed(seed, "hessian_sample"))
        picks = torch.randperm(total, generator=gen)[:want]
        starts = torch.tensor([0] + sizes).cumsum(0)
        owner = torch.searchsorted(starts, picks, right=True) - 1
        xs, ys = [None] * want, [None] * want
        for cid in sorted(set(owner.tolist())):
            c = self.data.client(cid)
            for pos in (owner == cid).nonzero().flatten().tolist():
                i = int(picks[pos] - starts[cid])
                xs[pos], ys[pos] = c.x[i], c.y[i]
        x, y = self._prepare(torch.stack(xs), torch.stack(ys))
        return batches_of(x, y, batch_size)

    def client_sample(self, cid: int, batch_size: int, max_samples: int, seed: int):
        """Client ``cid``'s training part (a seeded subsample of ``max_samples`` when larger)."""
        c = self.data.client(cid)
        x, y = c.x, c.y
        if max_samples and y.shape[0] > max_samples:
            gen = torch.Generator().manual_seed(derive_seed(seed, "hessian_client_sample", cid))
            idx = torch.randperm(y.shape[0], generator=gen)[:max_samples].sort().values
            x, y = x[idx], y[idx]
        x, y = self._prepare(x, y)
        return batches_of(x, y, batch_size), int(y.shape[0])


# --------------------------------------------------------------------------- the command

def analyse(args, world) -> Dict[str, object]:
    """Everything the command measures, identical on every rank."""
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    run = RunAnalysis(args.run_dir, args.data_dir, world, dtype)
    result: Dict[str, object] = {"run_dir": os.path.abspath(args.run_dir), "algo": run.cfg.algo,
                                 "seed": args.seed, "dtype": args.dtype, "ranks": world.size}

    _check_global_model(run, args)
    plan = None if args.skip_matching else _matching_plan(run, args)
    # Every model file is read once before any Hessian work: a truncated file found after an
    # hour of power iterations would waste the hour. Client models are checked by the rank that
    # will use them, and a failure reaches every rank (a rank failing alone would leave the
    # others in the next collective).
    mine = [] if args.skip_global else [args.model or os.path.join(args.run_dir, "final_model.pt")]
    if plan is not None:
        mine += [path for i, (_, path) in enumerate(plan[1]) if i % world.size == world.rank]
    failure = None
    try:
        for path in dict.fromkeys(mine):
            run.load(path)
    except FedHPCError as e:
        failure = e
    if any(world.all_gather_object(failure is not None)):
        world.raise_together(failure, "reading the model files")

    central = run.central_sample(args.batches, args.batch_size, args.seed)
    n_central = sum(int(y.shape[0]) for _, y in central)
    if not args.skip_global:
        run.load(args.model or os.path.join(args.run_dir, "final_model.pt"))
        mine = [b for i, b in enumerate(central) if i % world.size == world.rank]
        obj = Objective(run.model, mine, n_central, world)
        eig, _, steps = top_eigenvalue(obj, args.iters, args.tol, args.seed)
        trace, samples = hutchinson_trace(obj, args.trace_iters, args.trace_tol, args.seed)
        result["global"] = {"model": args.model or "final_model.pt", "data": "central", "samples": n_central,
                            "loss": obj.loss(), "lambda_max": eig, "power_steps": steps,
                            "trace": trace, "trace_samples": samples}

    if not args.skip_matching:
        result["matching"] = _matching(run, args, plan, central, n_central, world)
    return result


def _check_global_model(run: RunAnalysis, args) -> None:
    """A run of a method that trains no global model (FD) wrote its untrained initial model as
    final_model.pt: lambda_max, the trace or H_k at that model would describe initialisation."""
    from ..registry import ALGORITHMS

    uses_global = not args.skip_global or (not args.skip_matching and args.matching_model == "global")
    if args.model is None and uses_global and not ALGORITHMS.get(run.cfg.algo).has_global_model:
        raise ConfigError(f"{run.cfg.algo} trains no global model: the run's final_model.pt is its untrained initial "
                          f"model. Measure the saved client models alone (--skip-global, --matching-model client) "
                          f"or name a model file with --model")


def _matching_plan(run: RunAnalysis, args) -> Tuple[Optional[int], List[Tuple[int, str]]]:
    """(round, [(client id, model file)]) of the H_N / H_D measurement, checked before any work."""
    rounds = saved_rounds(args.run_dir)
    round_ = args.round or (rounds[-1] if rounds else None)
    if args.client_ids:
        cids = args.client_ids
        wrong = [c for c in cids if c >= run.data.num_clients]
        if wrong:
            raise ConfigError(f"--clients {args.clients}: the run has clients 0..{run.data.num_clients - 1}, "
                              f"not {wrong}")
    elif round_ is not None:
        cids = saved_clients(args.run_dir, round_)
    else:
        cids = list(range(run.data.num_clients)) if args.matching_model == "global" else []
    if args.matching_model == "client":
        if round_ is None:
            raise DataError(f"{args.run_dir} holds no saved client models: rerun with --save-client-models last "
                            f"(or ROUNDS), or pass --matching-model global or --skip-matching")
        if not cids:
            raise DataError(f"no saved client models at round {round_} under {args.run_dir}/client_models "
                            f"(saved rounds: {rounds or 'none'}); pick one of those with --round")
        missing = [c for c in cids if c not in saved_clients(args.run_dir, round_)]
        if missing:
            raise DataError(f"no saved model of client(s) {missing} at round {round_} in "
                            f"{client_models_dir(args.run_dir, round_)}")
        paths = [os.path.join(client_models_dir(args.run_dir, round_), f"client_{c:06d}.pt") for c in cids]
    else:
        paths = [args.model or os.path.join(args.run_dir, "final_model.pt")] * len(cids)
    if args.pairs == "distinct" and len(cids) < 2:  # hessian_matching would say so after the diagonals
        raise DataError(f"H_N and H_D over distinct pairs need at least two clients, got {cids}; save more "
                        f"client models, pass more --clients, or pass --pairs all")
    return round_, list(zip(cids, paths))


def _matching(run: RunAnalysis, args, plan, central, n_central: int, world) -> Dict[str, object]:
    round_, models = plan
    cids = [c for c, _ in models]
    diags: Dict[int, torch.Tensor] = {}
    for i, (cid, path) in enumerate(models):
        if i % world.size != world.rank:
            continue
        run.load(path)
        if args.matching_data == "central":
            obj = Objective(run.model, central, n_central)
        else:
            batches, n = run.client_sample(cid, args.batch_size, args.max_client_samples, args.seed)
            obj = Objective(run.model, batches, n)
        d = hessian_diagonal(obj, args.diag_samples, args.seed, args.diag_method, key=cid)
        diags[cid] = layerwise(d, obj.sizes) if args.diagonal == "layerwise" else d
    for part in world.all_gather_object(diags):
        diags.update(part)
    ordered = [diags[c] for c in cids]
    hn, hd = hessian_matching(ordered, args.pairs)
    return {"H_N": hn, "H_D": hd, "clients": cids, "round": round_, "model": args.matching_model,
            "data": args.matching_data, "diagonal": args.diagonal, "diag_method": args.diag_method,
            "diag_samples": args.diag_samples if args.diag_method == "hutchinson" else None,
            "pairs": args.pairs, "diag_norms": {str(c): float(diags[c].norm()) for c in cids}}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fedhpc.analysis.hessian", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="the --out folder of a finished run (config.yaml, final_model.pt)")
    ap.add_argument("--model", help="global model file instead of RUN_DIR/final_model.pt")
    ap.add_argument("--data-dir", help="where the dataset lives now, if not where the run read it")
    ap.add_argument("--batches", type=int, default=10, help="batches of the centralized training set (10)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=100, help="power-iteration steps at most (100)")
    ap.add_argument("--tol", type=float, default=1e-3, help="power iteration's relative tolerance (1e-3)")
    ap.add_argument("--trace-iters", type=int, default=100, help="Hutchinson samples at most (100)")
    ap.add_argument("--trace-tol", type=float, default=1e-3, help="Hutchinson's stopping tolerance (0 = all samples)")
    ap.add_argument("--round", type=int, default=0, help="round of the saved client models (default: the latest)")
    ap.add_argument("--clients", default="", help="comma-separated client ids (default: those saved at --round)")
    ap.add_argument("--matching-model", choices=("client", "global"), default="client",
                    help="H_k at client k's saved model (default) or at the global model")
    ap.add_argument("--matching-data", choices=("client", "central"), default="client",
                    help="H_k on client k's own training data (default) or the centralized sample (authors)")
    ap.add_argument("--max-client-samples", type=int, default=0, help="cap on a client's samples (0 = all)")
    ap.add_argument("--diagonal", choices=("true", "layerwise"), default="true",
                    help="true diagonal (default) or the authors' per-tensor block traces")
    ap.add_argument("--diag-method", choices=("hutchinson", "exact"), default="hutchinson",
                    help="Hutchinson's diagonal estimator (default) or one HVP per parameter (small models)")
    ap.add_argument("--diag-samples", type=int, default=100, help="Rademacher samples per diagonal (100)")
    ap.add_argument("--pairs", choices=("distinct", "all"), default="distinct",
                    help="average over client pairs k < j (default) or all ordered pairs incl. k = j (authors)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the sample and every random vector")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--skip-global", action="store_true", help="no lambda_max / trace")
    ap.add_argument("--skip-matching", action="store_true", help="no H_N / H_D")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", help="result file (default RUN_DIR/hessian.json)")
    return ap


def _validate(args) -> None:
    for name in ("batches", "batch_size", "iters", "trace_iters", "diag_samples"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.tol < 0 or args.trace_tol < 0 or args.max_client_samples < 0 or args.round < 0:
        raise ConfigError("--tol, --trace-tol, --max-client-samples and --round must be >= 0")
    try:
        ids = [int(c) for c in args.clients.split(",") if c.strip()] if args.clients.strip() else []
    except ValueError:
        ids = None
    if ids is None or any(c < 0 for c in ids) or (args.clients.strip() and not ids):
        raise ConfigError(f"--clients takes comma-separated client ids (integers >= 0, e.g. --clients 0,3,7), "
                          f"got {args.clients!r}")
    args.client_ids = sorted(set(ids))


def _check_out(path: str) -> Optional[str]:
    """Why the result cannot be written to ``path`` (None: it can). Checked before the analysis, which
    can take hours, so that an unwritable --out does not throw its result away; a probe file is
    written and removed, as permissions alone do not tell (root on a read-only mount)."""
    if os.path.isdir(path):
        return f"--out {path} is a folder; pass a file name, e.g. {os.path.join(path, 'hessian.json')}"
    try:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        probe_write(directory)
    except OSError as e:
        return (f"cannot write the result to {path} ({e.strerror or e}); pass --out a file in a folder you "
                f"can write to")
    return None


def main(argv: Optional[List[str]] = None) -> int:
    from ..world import World

    world = None
    try:
        args = build_parser().parse_args(argv)
        _validate(args)
        world = World(args.device, args.threads)
        out = args.out or os.path.join(args.run_dir, "hessian.json")
        # rank 0 alone writes, so it alone checks; every rank learns the answer and stops with it
        problem = world.all_gather_object(_check_out(out) if world.rank == 0 else None)[0]
        if problem:
            raise ConfigError(problem)
        result = analyse(args, world)
        if world.rank == 0:
            atomic_write_json(out, result)
            print(json.dumps({k: v for k, v in result.items() if k in ("global", "matching")}, indent=1,
                             default=str)[:4000], flush=True)
            print(f"written to {out}", flush=True)
        return 0
    except FedHPCError as e:
        if world is None or world.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        if world is not None:
            world.close()


if __name__ == "__main__":  # python -m fedhpc.analysis.hessian
    sys.exit(main())
