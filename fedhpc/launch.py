"""``python -m fedhpc.launch``: the one entry point, alone or under mpiexec / srun / torchrun."""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import List, Optional

from .errors import ConfigError, FedHPCError, OutputError, RankFailure


def _refuse_existing_run(cfg) -> None:
    if cfg.out and not cfg.resume and os.path.isdir(cfg.out):
        # An empty metrics.jsonl (a run stopped in its first round, e.g. by a NaN loss) holds
        # nothing to lose: the same --out takes the corrected command.
        held = [f for f in ("metrics.jsonl", "checkpoints", "final_model.pt") if os.path.exists(os.path.join(cfg.out, f))
                and not (f == "metrics.jsonl" and os.path.getsize(os.path.join(cfg.out, f)) == 0)]
        if held:
            raise ConfigError(f"--out {cfg.out} already holds a run ({', '.join(held)}); pass --resume "
                              f"to continue it, or choose another --out")


def _check_out_is_writable(cfg) -> None:
    """--out must be (or become) a writable directory: found now, not after the data has loaded
    and the model is built (or, on a read-only path, at the first checkpoint)."""
    if not cfg.out:
        return
    out = os.path.abspath(cfg.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {cfg.out} is a file, not a directory; choose another --out")
    existing = out
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"--out {cfg.out} lies under {existing}, which is a file; choose another --out")
    from .io import probe_write

    try:
        probe_write(existing)
    except OSError as e:
        raise ConfigError(f"--out {cfg.out}: cannot write in {existing} ({e.strerror}); fix its permissions "
                          f"or choose another --out")


#: where a run that names no --out writes (relative to the working folder), as scripts/run_main.sh does
DEFAULT_RUNS_DIR = "runs"


def default_run_folder(cfg, now: Optional[float] = None) -> str:
    """``runs/<algo>_<dataset>_<YYYYmmdd-HHMMSS>`` for a run without --out, made unique with a
    ``-2``, ``-3``... suffix when a run started in the same second already took the name."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = os.path.join(DEFAULT_RUNS_DIR, f"{cfg.algo}_{cfg.dataset}_{stamp}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def main(argv: Optional[List[str]] = None) -> int:
    """The command line (``python -m fedhpc.launch``, the ``fedhpc`` command): returns the exit code.
    A run without ``--out`` writes to :func:`default_run_folder` (said on the first line);
    ``--no-out`` / ``--out none`` write nothing."""
    from .config import launcher_rank, parse_args

    world = None
    graceful = True
    cfg = None
    defaulted: List[str] = []

    def default_out(c) -> str:
        defaulted.append(default_run_folder(c))
        return defaulted[-1]

    try:
        cfg, algo_options, data_options = parse_args(argv, default_out=default_out)
        _refuse_existing_run(cfg)
        _check_out_is_writable(cfg)
        from .engine import EXIT_PREEMPTED, Engine, Preempted
        from .world import World

        world = World(cfg.device, cfg.threads, cfg.collective_timeout, cfg.collective_backend, cfg.deterministic)
        if defaulted:
            # each rank read its own clock: all write where rank 0 does
            cfg.out = world.broadcast_object(cfg.out)
            if world.rank == 0:
                print(f"fedhpc: writing to {cfg.out} (no --out given; --out DIR chooses the folder, --no-out "
                      f"writes nothing)", flush=True)
        if world.rank == 0 and world.backend_note:
            print(f"note: {world.backend_note}", file=sys.stderr, flush=True)
        if world.rank == 0 and world.thread_note:
            print(f"warning: {world.thread_note}", file=sys.stderr, flush=True)
        engine = Engine(cfg, algo_options, data_options, world)
        try:
            engine.run()
        except Preempted as p:
            if not cfg.out:  # nothing was saved: not the "checkpointed, run again" exit a requeue acts on
                if world.rank == 0:
                    print(f"stopped by signal after round {p.round_done}; nothing was saved (no --out), so the "
                          f"run cannot be continued; give --out DIR (or leave out --no-out) to make a run resumable",
                          file=sys.stderr, flush=True)
                return 1
            if world.rank == 0:
                print(f"stopped by signal after round {p.round_done}; checkpoint written to "
                      f"{cfg.out}/checkpoints. Continue with the same command plus --resume",
                      file=sys.stderr, flush=True)
            return EXIT_PREEMPTED
        return 0
    except RankFailure as e:
        graceful = False
        print(f"[rank {world.rank if world else launcher_rank()}] error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except OutputError as e:
        # A disk that fills or a permission that changes strikes one rank at one write: the
        # others would wait for it in the next collective, so bring them down.
        graceful = False
        print(f"[rank {world.rank if world else launcher_rank()}] error: {e}", file=sys.stderr, flush=True)
        if world is not None:
            world.abort(e.exit_code)
        return e.exit_code
    except FedHPCError as e:
        # Errors from configuration, data and checkpoints are the same on every rank and
        # NaN losses are agreed on collectively: rank 0 speaks for all (before the World
        # exists, as the launcher numbered the processes).
        if (world.rank if world is not None else launcher_rank()) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        graceful = False
        if (world.rank if world is not None else launcher_rank()) == 0:
            kept = (f"; the last checkpoint in {cfg.out}/checkpoints is intact: continue with the same "
                    f"command plus --resume" if cfg is not None and cfg.out else "")
            print(f"interrupted{kept}", file=sys.stderr, flush=True)
        return 130
    except Exception:
        graceful = False
        rank = world.rank if world is not None else launcher_rank()
        print(f"[rank {rank}] unexpected failure:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if world is not None:
            world.abort(1)  # bring the other ranks down instead of leaving them in a collective
        return 1
    finally:
        if world is not None:
            world.close(graceful)


def exit_now(code: int) -> None:
    """Leave the process without interpreter teardown once every output is written and the
    process group is destroyed: torch 2.13's gloo can still abort at that point ("terminate
    called without an active exception", exit 6) now and then on a loaded machine, which would
    turn a finished run into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cli() -> None:
    """The ``fedhpc`` command (pyproject.toml's entry point): :func:`main`, left as ``python -m
    fedhpc.launch`` leaves it (:func:`exit_now`)."""
    exit_now(main())


if __name__ == "__main__":
    exit_now(main())
