"""``fedhpc.run``: a run from Python (a notebook, a script, a rank of ``mpiexec``), beside the command line.

    import fedhpc
    r = fedhpc.run("launch/digits_fedavg.yaml", rounds=5, lr=0.1)   # a launch file and overrides
    r = fedhpc.run(algo="fedprox", mu=0.01, rounds=20)               # keyword settings alone
    r = fedhpc.run({"algo": "fedmix", "algo_options": {"lam": 0.05}})  # a dict written as the YAML is
    r.final["test_accuracy"], r.rounds[-1], r.global_state, r.client_states, r.out

The settings are the launch YAML keys and mean what the command line's flags mean
(:func:`fedhpc.config.cli.settings_args`); they are validated before anything runs, and a bad one
raises :class:`fedhpc.errors.ConfigError` with the launcher's message. Unlike the command line, a
run without ``out=`` writes nothing: the result holds it all.

Under ``mpiexec`` / ``srun`` / ``torchrun`` every rank calls ``fedhpc.run`` with the same settings
and gets the same result (the clients' models gathered from the ranks that hold them). Each call
makes its process group and destroys it at the end (MPI itself stays up: a process initialises it
once), so a process may call it again; torch's thread count, random state and deterministic-kernel
settings are restored afterwards, and the engine puts back the SIGTERM / SIGUSR1 handlers it
installs for the run (it must run in the main thread, where Python delivers signals).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

from .errors import FedHPCError, OutputError, RankFailure

__all__ = ["RunResult", "RunStopped", "run"]


class RunStopped(FedHPCError):
    """SIGTERM / SIGUSR1 stopped the run after a round (a checkpoint was written when it had ``out``)."""

    exit_code = 75


@dataclass
class RunResult:
    """What :func:`run` returns (the same on every rank)."""

    #: the settings the run used, resolved and validated (:class:`fedhpc.config.RunConfig`)
    config: Any
    #: one dict per round, as metrics.jsonl holds them: every round's training metrics, and an
    #: evaluated round's evaluation (every ``eval_every``-th round and the last)
    rounds: List[Dict[str, Any]]
    #: the final evaluation (the last round's record; test_accuracy, local_test_accuracy_mean...)
    final: Dict[str, Any]
    #: the final global model as a state dict on the CPU (what final_model.pt holds)
    global_state: Dict[str, Any]
    #: client id -> state dict of the model that client uses, for methods whose clients keep models of
    #: their own (personal methods, FD, devices a lost broadcast left on their own model); None when
    #: every client uses the global model, or when ``client_models=False`` skipped gathering them
    client_states: Optional[Dict[int, Dict[str, Any]]] = None
    #: the run folder (metrics.jsonl, final_model.pt, checkpoints, TensorBoard), or None
    out: Optional[str] = None
    #: name of the model the run built (``model: auto`` resolved)
    model: str = ""

    def metric(self, name: str) -> List[Any]:
        """``[(round, value), ...]`` of metric ``name`` over the rounds that logged it."""
        return [(r["round"], r[name]) for r in self.rounds if name in r]


@contextlib.contextmanager
def _torch_state_kept() -> Iterator[None]:
    """Put back what a run sets process-wide in torch: threads (the World sets them per rank), the
    default random generators (the engine seeds them), the current GPU (the World picks its rank's)
    and the GPU numerics (``gpu_numerics``)."""
    import torch

    threads = torch.get_num_threads()
    cpu_rng = torch.random.get_rng_state()
    cuda_up = torch.cuda.is_available() and torch.cuda.is_initialized()
    cuda_rng = torch.cuda.get_rng_state_all() if cuda_up else None
    device = torch.cuda.current_device() if cuda_up else 0
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.utils.deterministic.fill_uninitialized_memory = flags[2]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags[3], flags[4]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[5], flags[6]


def _engine_class():
    from .engine import Engine

    class RecordingEngine(Engine):
        """The engine, keeping every round's record as it logs it (metrics.jsonl's lines, on every rank)."""

        def _log(self, metrics, echo=True):
            self.records = [r for r in getattr(self, "records", []) if r["round"] < metrics["round"]]
            self.records.append(dict(metrics))
            super()._log(metrics, echo)

    return RecordingEngine


def _client_states(engine, world) -> Optional[Dict[int, Dict[str, Any]]]:
    """Collective: every client's own model (``Algorithm.client_model``) from the rank holding its state."""
    mine = {}
    for cid in engine.client_state.held():
        flat = engine.algo.client_model(cid)
        if flat is not None:
            mine[cid] = engine.flat.state_dict_from(flat)
    states: Dict[int, Dict[str, Any]] = {}
    for part in world.all_gather_object(mine):
        states.update(part)
    return dict(sorted(states.items())) or None


def _records(cfg, engine, world) -> List[Dict[str, Any]]:
    """The run's rounds: metrics.jsonl's when the run has a folder (a resumed run's earlier rounds
    too), else what this call logged."""
    if cfg.out:
        from .sweep.state import read_metrics

        return world.broadcast_object(read_metrics(cfg.out) if world.rank == 0 else None)
    return list(getattr(engine, "records", []))


def run(config: Any = None, *, client_models: bool = True, **settings: Any) -> RunResult:
    """Run one federated training and return its :class:`RunResult`.

    ``config``: a launch YAML file's path (``launch/*.yaml``), a dict of the same keys, or None
    (the defaults). ``settings``: keyword settings named as the YAML keys, overriding ``config`` as
    the command line's flags override a file: ``rounds=5``, ``algo="fedprox"``, the algorithm's
    options (``mu=0.01``, as ``--mu``), ``data_options={"test_fraction": 0.3}`` (its keys replace the
    file's, as ``--data-opt`` does), ``out="runs/x"`` to write the run's folder (default: none),
    ``resume=True`` with ``out`` to continue one. ``client_models=False`` skips gathering the
    clients' own models (every rank receives all of them).

    Raises :class:`fedhpc.errors.ConfigError` (and the other :class:`~fedhpc.errors.FedHPCError`
    subclasses: data, checkpoint, output problems, a NaN loss) with the launcher's messages, and
    :class:`RunStopped` when a SIGTERM / SIGUSR1 stopped the run. Under several ranks an error that
    is not one every rank raises together brings all of them down, as the launcher does, instead
    of leaving the others waiting in a collective.
    """
    from .config.cli import settings_args
    from .engine import Preempted

    cfg, algo_options, data_options = settings_args(config, settings)
    from .launch import _check_out_is_writable, _refuse_existing_run

    _refuse_existing_run(cfg)
    _check_out_is_writable(cfg)
    from .world import World

    with _torch_state_kept():
        world = World(cfg.device, cfg.threads, cfg.collective_timeout, cfg.collective_backend, cfg.deterministic)
        graceful = True
        try:
            engine = _engine_class()(cfg, algo_options, data_options, world)
            # the clients' states are read after the run: keep spilled ones on disk until then
            close_store, engine.client_state.close = engine.client_state.close, lambda: None
            try:
                try:
                    final = engine.run()
                except Preempted as p:
                    saved = (f"; a checkpoint is in {cfg.out}/checkpoints: call again with resume=True" if cfg.out
                             else "; nothing was saved (no out=)")
                    raise RunStopped(f"stopped by a signal after round {p.round_done}{saved}") from None
                clients = _client_states(engine, world) if client_models else None
                records = _records(cfg, engine, world)
            finally:
                close_store()
            return RunResult(config=cfg, rounds=records, final=dict(final),
                             global_state=engine.flat.state_dict_from(engine.global_state),
                             client_states=clients, out=os.path.abspath(cfg.out) if cfg.out else None,
                             model=engine.model_name)
        except RankFailure:
            graceful = False  # a peer died: no closing barrier
            raise
        except OutputError as e:
            graceful = False  # one rank's disk failed: the others would wait for it in the next collective
            world.abort(e.exit_code)
            raise
        except FedHPCError:
            raise  # configuration, data and NaN losses: every rank raises it together
        except BaseException:
            graceful = False
            world.abort(1)  # several ranks: bring the others down instead of leaving them in a collective
            raise
        finally:
            # the process group goes; MPI stays initialised for the next call (mpi4py finalises it at exit)
            world.close(graceful, finalize_mpi=False)

