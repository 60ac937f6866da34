"""Random launcher configurations on the embedded digits: which ones end in a traceback?

    .venv/bin/python scripts/probe_configs.py --seed 7 --count 250 [--out-dir /tmp/probe]

Each configuration draws an algorithm, a model with options it takes, a partition, client counts,
batch size, epochs, rounds and a handful of run features (channel, cold-start clients,
--final-adapt, batched clients, adam or momentum, eval cadence, lr decay, --stop-epsilon,
per-label accuracy, saved client models, checkpoints every round, a sampled local evaluation,
eval batches of 7 samples, which straddle clients and split over ranks); a quarter run on 2 MPI
ranks. (A feature added to the list moves the draws of every seed after it.)
Every run must end trained (exit 0), or stopped by one `error:` line: refused (exit 2) or
diverged (exit 3, a NaN loss, which random learning settings can give). A traceback, another exit
code (4: a rank died) or a 10-minute timeout is a finding, printed with its command line and the
end of its stderr. Exits 1 when there is any finding. Not part of the suite (about 5 s per
run on 2 cores): a probe for the bad-input rule, which found that --batch-size 1 escaped the
BatchNorm single-sample check.

``--resume-check``: each configuration that trains runs 4 rounds with a checkpoint every round,
and again as K rounds (K drawn in 1..3) extended to 4 with --resume, on the same number of ranks;
a final model that differs in any bit, or metrics rows whose accuracies and losses differ, is a
finding (the standard set's resume test, over combinations of run features it does not draw).
Methods whose updates read --rounds (identity_settings) cannot be extended and are skipped.

``--ranks-check``: each configuration runs on 1 rank and on ``--ranks`` MPI ranks (default 2);
the final models must be equal bit for bit and the metrics rows' accuracies and losses equal
(the standard set's 1-vs-2-ranks test, over the same combinations). Configurations with fewer
clients per round than ranks still run: a rank with no client that round must not change the
result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

#: per model, option sets it accepts (one is drawn; [] = its defaults)
MODEL_OPTIONS = {
    "auto": [[]], "mlp": [["hidden=16"], ["depth=3"]], "cnn": [["norm=batch"], ["dropout=0.3"], ["width=4"]],
    "resnet_digits": [["width=4"], ["width=4", "projection_dim=8"], ["width=4", "norm=none"]],
    "pmixfed_cnn_digits": [["norm=none"], ["dropout=0.2"], []], "mobilenet": [["width_multiplier=0.25"]],
    "lenet5": [[]],
}
PARTITIONS = ["iid", "dirichlet:0.3", "dirichlet:1.0", "classes:2", "classes_cyclic:3", "skewed:2:1:13",
              "deficient:0,2:1:10"]
#: methods that need a residual model (refused with another one: drawn mostly with one)
RESIDUAL = ("fedalign", "gradaug", "stochdepth", "moon")
SERVER_SET = ["--data-opt", "server_per_label=20", "--data-opt", "server_deficient=0,2",
              "--data-opt", "server_deficient_count=3"]


def draw(rng: random.Random, algos: List[str]) -> List[str]:
    """One configuration's launcher flags (without --out)."""
    algo = rng.choice(algos)
    clients = rng.randint(3, 12)
    model = "resnet_digits" if algo in RESIDUAL and rng.random() < 0.8 else rng.choice(sorted(MODEL_OPTIONS))
    argv = ["--algo", algo, "--model", model, "--partition", rng.choice(PARTITIONS), "--num-clients", str(clients),
            "--clients-per-round", str(rng.randint(1, clients)), "--batch-size", str(rng.choice([1, 2, 3, 10, 64])),
            "--local-epochs", str(rng.randint(1, 2)), "--rounds", str(rng.randint(1, 3)), "--seed", str(rng.randint(0, 5)),
            "--threads", "1", "--no-tensorboard", "--quiet"]
    for option in rng.choice(MODEL_OPTIONS[model]):
        argv += ["--model-opt", option]
    if algo == "moon" and model == "resnet_digits" and "projection_dim=8" not in argv:
        argv += ["--model-opt", "projection_dim=8"]
    features = [
        (0.3, ["--channel", rng.choice(["symmetric", "asymmetric"])]), (0.2, ["--cold-start-fraction", "0.3"]),
        (0.2, ["--final-adapt"]), (0.15, ["--clients-at-once", "3"]), (0.15, ["--client-test-fraction", "0"]),
        (0.2, ["--eval-every", "2"]), (0.15, ["--lr-decay", "0.9"]), (0.15, ["--stop-epsilon", "0.5"]),
        (0.15, ["--per-label-accuracy"]), (0.1, ["--save-client-models", "1"]), (0.2, ["--checkpoint-every", "1"]),
        (0.3, rng.choice([["--optimizer", "adam"], ["--momentum", "0.9", "--weight-decay", "1e-4", "--grad-clip", "1"]])),
        (0.2, ["--local-eval-clients", "3"]), (0.2, ["--eval-batch-size", "7"]),
    ]
    for chance, flags in features:
        if rng.random() < chance:
            argv += flags
    if algo in ("mixfl", "xormixfl", "standalone") or rng.random() < 0.1:
        argv += SERVER_SET
    if algo in ("fld", "mixfld", "mix2fld"):
        argv += ["--server-steps", "20"]  # the paper's 3,200 make a probe run minutes long
    return argv


def _without(flags: List[str], *names: str) -> List[str]:
    """``flags`` without the flags ``names`` and their values."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] in names:
            i += 2
            continue
        out.append(flags[i])
        i += 1
    return out


def _records(out: str) -> List[dict]:
    """metrics.jsonl's rounds with their accuracies and losses (timings differ run to run)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k == "round" or "accuracy" in k or "loss" in k}
                for line in f]


def resume_difference(launch, flags: List[str], k: int, out: str) -> Optional[str]:
    """None when K rounds extended to 4 with --resume end as 4 uninterrupted rounds do; else what
    differs. ``launch(flags) -> (exit code, stderr)``; the uninterrupted run must have trained."""
    flags = _without(flags, "--rounds", "--checkpoint-every", "--save-client-models")
    whole, parts = os.path.join(out, "whole"), os.path.join(out, "parts")
    steps = [(whole, ["--rounds", "4"]), (parts, ["--rounds", str(k)]), (parts, ["--rounds", "4", "--resume"])]
    for folder, extra in steps:
        code, err = launch([*flags, "--checkpoint-every", "1", *extra, "--out", folder])
        if code != 0:
            if folder == whole:
                return None  # refused or diverged: nothing to compare (the plain probe judges those)
            what = f"the run to {extra[1]} rounds" + (" (--resume)" if "--resume" in extra else "")
            return f"{what} exited {code}: {err[-600:]}"
    return outputs_difference(whole, parts)


def outputs_difference(one: str, other: str) -> Optional[str]:
    """None when two runs' final models are equal bit for bit and their metrics rows' accuracies
    and losses equal; else what differs."""
    import torch

    a, b = (torch.load(os.path.join(d, "final_model.pt"), weights_only=True) for d in (one, other))
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    if differ:
        return f"final models differ in {differ[:3]}"
    if _records(one) != _records(other):
        return "metrics.jsonl's accuracies or losses differ"
    return None


def ranks_difference(launch, flags: List[str], out: str, ranks: int = 2) -> Optional[str]:
    """None when the configuration ends alike on 1 and ``ranks`` ranks; else what differs.
    ``launch(flags, ranks) -> (exit code, stderr)``."""
    one, two = os.path.join(out, "one"), os.path.join(out, "two")
    code, _ = launch([*flags, "--out", one], 1)
    if code != 0:
        return None  # refused or diverged: the plain probe judges those
    code, err = launch([*flags, "--out", two], ranks)
    if code != 0:
        return f"the {ranks}-rank run exited {code} where 1 rank trained: {err[-600:]}"
    return outputs_difference(one, two)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--two-ranks", type=float, default=0.25, help="share of runs on 2 MPI ranks")
    parser.add_argument("--out-dir", default=os.path.join("/tmp", "fedhpc-probe-configs"))
    parser.add_argument("--resume-check", action="store_true",
                        help="compare K rounds resumed to 4 with 4 uninterrupted rounds (see the module docstring)")
    parser.add_argument("--ranks-check", action="store_true",
                        help="compare each configuration on 1 and on --ranks MPI ranks (see the module docstring)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks --ranks-check compares with 1 (default 2)")
    args = parser.parse_args(argv)

    from fedhpc.algorithms import ALGORITHMS, load_algorithm_modules

    load_algorithm_modules()
    algos = ALGORITHMS.names()
    rng = random.Random(args.seed)
    bindir = os.path.dirname(sys.executable)
    mpiexec = shutil.which("mpiexec", path=bindir) or shutil.which("mpiexec")
    if args.ranks_check and mpiexec is None:
        parser.error("--ranks-check needs mpiexec: run scripts/setup_env.sh, which installs mpich into .venv")
    findings, trained, compared = 0, 0, 0
    for i in range(args.count):
        flags = draw(rng, algos)
        out = os.path.join(args.out_dir, f"run{args.seed}_{i}")
        two = rng.random() < args.two_ranks and mpiexec is not None  # drawn alike with or without MPI
        k = rng.randint(1, 3)

        def launch(launcher_flags: List[str], ranks: Optional[int] = None):
            ranks = ranks or (2 if two else 1)
            cmd = ([mpiexec, "-n", str(ranks)] if ranks > 1 else []) + [sys.executable, "-m", "fedhpc.launch",
                                                                        *launcher_flags]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
                return proc.returncode, proc.stderr
            except subprocess.TimeoutExpired:
                return None, "timed out after 600 s"

        if args.ranks_check or args.resume_check:
            if args.resume_check and "rounds" in ALGORITHMS.get(flags[1]).identity_settings:
                continue
            if args.ranks_check:
                difference, second = ranks_difference(launch, flags, out, args.ranks), "two"
                where = {"ranks": [1, args.ranks]}
            else:
                difference, second = resume_difference(launch, flags, k, out), "parts"
                where = {"ranks": 2 if two else 1, "k": k}
            compared += os.path.exists(os.path.join(out, second))  # both runs trained
            shutil.rmtree(out, ignore_errors=True)
            if difference:
                findings += 1
                print(json.dumps({"run": i, **where, "flags": " ".join(flags), "difference": difference}), flush=True)
            continue
        code, err = launch([*flags, "--out", out])
        shutil.rmtree(out, ignore_errors=True)
        trained += code == 0
        stopped_cleanly = code in (2, 3) and (err.strip().splitlines() or [""])[-1].startswith("error: ")
        if "Traceback" in err or not (code == 0 or stopped_cleanly):
            findings += 1
            print(json.dumps({"run": i, "ranks": 2 if two else 1, "exit": code, "flags": " ".join(flags),
                              "stderr_tail": err[-1500:]}), flush=True)
    if args.ranks_check or args.resume_check:
        what = f"run on 1 and {args.ranks} ranks" if args.ranks_check else "resumed"
        print(f"{args.count} configurations (seed {args.seed}): {compared} {what} and compared, "
              f"{findings} finding(s)")
    else:
        print(f"{args.count} configurations (seed {args.seed}): {trained} trained, "
              f"{args.count - trained - findings} stopped by an error line, {findings} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
