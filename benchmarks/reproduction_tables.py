"""The reproduction tables of README / RESULTS.md, laid out as the papers lay them out.

Reads what ``python -m fedhpc.report`` wrote for each mnist5k sweep (its ``summary.json``: one
group per setting, mean and sample std over seeds, the paper's value where the launch file or
sweep names one) and pivots it into one markdown table per paper: methods down, the paper's
columns across, each cell "fedhpc mean ± std [paper]". Nothing is computed here that the report
did not compute; this only lays it out.

    python -m fedhpc.sweep sweeps/<name>.yaml --local
    python -m fedhpc.report runs/sweeps/<name> --out runs/sweeps/<name>/report
    python benchmarks/reproduction_tables.py [--sweeps runs/sweeps]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

Group = dict


def load(sweeps: str, name: str) -> Optional[List[Group]]:
    path = os.path.join(sweeps, name, "report", "summary.json")
    if not os.path.exists(path):
        return None
    return json.load(open(path))["groups"]


def cell(g: Group, metric: str, scale: float = 100.0, digits: int = 2) -> Tuple[str, Optional[float]]:
    """'mean ± std [paper]' of ``metric`` at the final round, or at the best round where the paper's
    number is one (``reference.stat: best``; the report's numbers either way)."""
    cmp = g.get("comparison")
    stat = cmp.get("stat", "final") if cmp and cmp.get("metric") == metric else "final"
    s = g["best" if stat == "best" else "final"].get(metric)
    if s is None:
        return "-", None
    mean, std = s["mean"] * scale, (s["std"] or 0.0) * scale
    text = f"{mean:.{digits}f} ± {std:.{digits}f}" if s["n"] > 1 else f"{mean:.{digits}f}"
    text += " (best)" if stat == "best" else ""
    if cmp and cmp.get("paper_value") is not None and cmp.get("metric") == metric:
        text += f" [{cmp['paper_value']:g}]"
    return text + ("" if s["n"] >= 3 else f" (n={s['n']})"), mean


def pivot(groups: List[Group], row: Callable[[Group], str], col: Callable[[Group], str], metric: str,
          rows: List[str], cols: List[str], corner: str, scale: float = 100.0, digits: int = 2) -> str:
    table: Dict[Tuple[str, str], str] = {}
    for g in groups:
        table[(row(g), col(g))] = cell(g, metric, scale, digits)[0]
    lines = [f"| {corner} | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in rows:
        lines.append(f"| {r} | " + " | ".join(table.get((r, c), "-") for c in cols) + " |")
    return "\n".join(lines)


def setting(g: Group, key: str, default=""):
    return g["settings"].get(key, default)


NAMES = {"xormixfl": "XorMixFL", "mixfl": "MixFL", "fedavg": "FL (FedAvg)", "standalone": "Standalone",
         "fd": "FD", "mixfld": "MixFLD", "mix2fld": "Mix2FLD", "fl": "FL", "pmixfed": "pMixFed",
         "fedalt": "FedAlt", "fedsim": "FedSim", "fedbabu": "FedBABU", "ditto": "Ditto", "per_fedavg": "Per-FedAvg",
         "lg_fedavg": "LG-FedAvg", "fedprox": "FedProx", "localmix": "LocalMix", "globalmix": "Global Mixup",
         "naivemix": "NaiveMix", "fedmix": "FedMix"}


def name(g: Group) -> str:
    return NAMES.get(setting(g, "algo"), setting(g, "algo"))


def plain(algo: str) -> str:
    """A method as FedMix's and pMixFed's tables call it: FedAvg plain (the others: FL / vanilla FL)."""
    return "FedAvg" if algo == "fedavg" else NAMES.get(algo, algo)


def plain_name(g: Group) -> str:
    return plain(setting(g, "algo"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweeps", default="runs/sweeps", help="the folder holding the sweeps' folders")
    args = ap.parse_args(argv)
    out: List[str] = []

    g = load(args.sweeps, "mix2fld_fig2_mnist5k")
    if g:
        label = {"skewed:2:2:40": "non-IID", "skewed:0:0:40": "IID"}
        col = lambda x: f"{label.get(setting(x, 'partition'), setting(x, 'partition'))}, {setting(x, 'channel')}"
        cols = [f"{p}, {c}" for p in ("non-IID", "IID") for c in ("asymmetric", "symmetric")]
        rows = ["FL (FedAvg)", "FD", "MixFLD", "Mix2FLD"]
        out += ["### Mix2FLD Fig. 2 on mnist5k: the reference device's final accuracy (%)", "",
                pivot(g, name, col, "reference_device_accuracy", rows, cols, "method"), "",
                "### Mix2FLD Fig. 2 on mnist5k: simulated time to the stopping rule (s; channel + compute model)", "",
                pivot(g, name, col, "sim_seconds_total", rows, cols, "method", scale=1.0, digits=1), ""]

    g = load(args.sweeps, "xormixfl_table2_mnist5k")
    if g:
        targets = sorted({setting(x, "data_options.server_deficient") for x in g}, key=lambda t: (t.count(","), t))
        out += ["### XorMixFL Table 2 on mnist5k: test accuracy (%) by target label(s) [paper, MNIST]", "",
                pivot(g, name, lambda x: f"({setting(x, 'data_options.server_deficient')})", "test_accuracy",
                      ["XorMixFL", "MixFL", "FL (FedAvg)", "Standalone"], [f"({t})" for t in targets], "method"), ""]

    g = load(args.sweeps, "xormixfl_table3_mnist5k")
    if g:
        out += ["### XorMixFL Table 3 on mnist5k: distance of an added sample to its raw samples "
                "(uint8 pixel units, 784 pixels) [paper's \"MDS\"]", "",
                pivot(g, lambda x: f"{name(x)}, {setting(x, 'algo_options.num_dummy', 1)} dummy",
                      lambda x: f"M = {setting(x, 'algo_options.max_blend', 2)}", "privacy_pixel_mean",
                      [f"{m}, {d} dummy" for m in ("XorMixFL", "MixFL") for d in (1, 2, 3)],
                      [f"M = {m}" for m in range(1, 6)], "method", scale=1.0, digits=0), ""]

    g = load(args.sweeps, "pmixfed_table2_mnist5k")
    if g:
        rows = [plain(a) for a in ("pmixfed", "fedavg", "fedalt", "fedsim", "fedbabu", "ditto", "per_fedavg",
                                   "lg_fedavg")]
        out += ["### pMixFed Table 2 (MNIST, N = 10, C = 100%) on mnist5k: mean personalised accuracy (%)", "",
                pivot(g, plain_name, lambda x: "mnist5k [paper]", "local_test_accuracy_mean", rows,
                      ["mnist5k [paper]"], "method"), ""]

    g = load(args.sweeps, "fedmix_mnist5k")
    if g:
        rows = [plain(a) for a in ("fedavg", "fedprox", "localmix", "globalmix", "naivemix", "fedmix")]
        out += ["### FedMix Table 1's six methods on mnist5k, 2 classes a client: test accuracy (%) "
                "[paper, FEMNIST]", "",
                pivot(g, plain_name, lambda x: "mnist5k [paper FEMNIST]", "test_accuracy", rows,
                      ["mnist5k [paper FEMNIST]"], "method"), ""]
    if not out:
        print(f"no report under {args.sweeps}/<sweep>/report/summary.json: run the sweeps and their reports first",
              file=sys.stderr)
        return 1
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
