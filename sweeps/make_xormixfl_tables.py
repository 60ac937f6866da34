"""Writes the XorMixFL paper's Tables 2 and 3 as sweeps (its numbers: benchmarks/compare_xormixfl.py,
PAPER_T2 / PAPER_T3): sweeps/xormixfl_table2_mnist5k.yaml, sweeps/xormixfl_table3_mnist5k.yaml and
the latter's saturating-sum twin sweeps/xormixfl_table3_mnist5k_saturating_sum.yaml.

Each sweep is one zip group because the paper's number belongs to a (method, column) cell, so
every cell is a point with its own ``reference.value``.

    python sweeps/make_xormixfl_tables.py --all    # Table 2: all 15 columns (the committed file)
    python sweeps/make_xormixfl_tables.py          # Table 2: 6 of them (0, 3, 9, (0,2), (4,8), (0,2,4,8))
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from compare_xormixfl import COLUMNS, NAMES, PAPER_ORDER, PAPER_T2, PAPER_T3  # noqa: E402

PAPER = "XOR Mixup / XorMixFL (Shin et al., arXiv 2006.05148, 2020)"
#: the committed Table 2 sweep's columns: one, two and four target labels; labels 0, 3 and 9 are the
#: paper's XorMixFL at 94.44, 93.99 and its lowest single label, 91.54
SOME_COLUMNS = ["0", "3", "9", "0,2", "4,8", "0,2,4,8"]
CONFIG = {"xormixfl": "launch/xormixfl_mnist5k.yaml", "mixfl": "launch/xormixfl_mnist5k.yaml",
          "fedavg": "launch/xormixfl_mnist5k_fedavg.yaml", "standalone": "launch/xormixfl_mnist5k.yaml"}


def write_grid(path: str, header: str, preamble: str, cells: list, minutes: int) -> None:
    """``cells``: one dict of point settings per cell, written as one zip group, x 3 seeds."""
    keys = list(cells[0])
    lines = [header.rstrip("\n"), preamble.rstrip("\n"), "zip:"]
    for i, key in enumerate(keys):
        values = ", ".join("null" if c[key] is None else json.dumps(c[key]) for c in cells)
        lines.append(("  - " if i == 0 else "    ") + f"{key}: [{values}]")
    lines += ["axes:", "  seed: [0, 1, 2]", "ranks: 1",
              f'slurm: {{cpus_per_task: 1, time: "00:{minutes:02d}:00", max_parallel: {len(cells) * 3}}}', ""]
    with open(os.path.join(REPO, path), "w") as f:
        f.write("\n".join(lines))


def table2(columns) -> None:
    cells = []
    for algo in PAPER_ORDER:
        encodes = algo in ("xormixfl", "mixfl")
        for column in columns:
            cells.append({"config": CONFIG[algo], "algo": algo, "partition": f"deficient:{column}:2:27",
                          "data_options.server_deficient": column,
                          "algo_options.num_dummy": 1 if encodes else None,
                          "algo_options.blend_alpha": 0.5 if encodes else None,
                          "algo_options.max_blend": 2 if encodes else None,
                          "reference.row": f"{NAMES[algo]}, target label(s) {column.replace(',', ', ')}",
                          "reference.value": PAPER_T2[column][PAPER_ORDER.index(algo)]})
    n = len(cells) * 3
    which = ("the table's 15 target-label\n# columns (0..9, (0,2), (0,8), (2,4), (4,8), (0,2,4,8))"
             if list(columns) == COLUMNS else
             f"{len(columns)} of the table's 15 target-label columns ({', '.join('(' + c + ')' for c in columns)})")
    write_grid("sweeps/xormixfl_table2_mnist5k.yaml", f"""\
# XorMixFL paper (003) Table 2 on the embedded real MNIST (launch/xormixfl_mnist5k.yaml says what is
# scaled: server base set 100 a label / 5 of a target label, devices 2 vs 27, 15 server epochs):
# XorMixFL, MixFL, vanilla FL and standalone x {which}
# x 3 seeds = {n} one-round runs of about 30 s, ~{n // 2} min on one core (--local runs one point at
# a time). Written by sweeps/make_xormixfl_tables.py (--all: every column) from the paper's table;
# Fig. 3's target-label accuracies are in each run's per-label accuracy (per_label_accuracy: true).
#   python -m fedhpc.sweep sweeps/xormixfl_table2_mnist5k.yaml --local
#   python -m fedhpc.report runs/sweeps/xormixfl_table2_mnist5k
""", "name: xormixfl_table2_mnist5k", cells, 20)


def table3(rule: str = "average") -> None:
    """Table 3's grid; ``rule="saturating_sum"`` writes its twin under the one blend reading found to
    make the distances grow with M (not the paper's text: --blend-rule's help)."""
    cells = []
    for (algo, dummies), row in PAPER_T3.items():
        for m, (mean, _std) in enumerate(row, start=1):
            cells.append({"algo": algo, "algo_options.num_dummy": dummies, "algo_options.max_blend": m,
                          "reference.paper": PAPER, "reference.table": "Table 3",
                          "reference.row": f"{NAMES[algo]}, {dummies} dummy label(s), M = {m}: distance to the raw samples",
                          "reference.metric": "privacy_pixel_mean", "reference.stat": "final",
                          "reference.value": mean})
    name = "xormixfl_table3_mnist5k" + ("" if rule == "average" else f"_{rule}")
    twin = "" if rule == "average" else f"""\
# This twin blends by --blend-rule {rule}: a label's samples summed and capped at 255 instead of
# averaged (Eq. 1). Not the paper's text; the one reading found under which the distances grow with
# M as the paper's do (benchmarks/RESULTS.md, XorMixFL Table 3). sweeps/xormixfl_table3_mnist5k.yaml
# is the paper's reading.
"""
    write_grid(f"sweeps/{name}.yaml", """\
# XorMixFL paper (003) Table 3 on the embedded real MNIST: how far each sample the server adds lies
# from the device samples blended into it (minimum distance, uint8 pixel units over the 784 pixels),
# XorMixFL (decoded) against MixFL (mixed up), for 1, 2, 3 dummy labels (drawn from labels 1, 2, 3)
# and M = 1..5 blended samples, target label 0, x 3 seeds = 90 runs of a few seconds: the server
# trains one epoch (its accuracy is not what this table reads). Devices hold 10 target samples (the
# Table 2 file's 2 would cap every blend at 2: "up to M" of what a device holds; blend_target_mean
# reports the M a run blends) and 27 of every other label. The report's metric is
# privacy_pixel_mean, the full-dimension distance; the paper calls its measure "MDS" and gives no
# embedding dimension (privacy_mds_mean is the 2-D classical-MDS distance, --mds-dims sets it).
# Written by sweeps/make_xormixfl_tables.py from the paper's table.
""" + twin + f"""\
#   python -m fedhpc.sweep sweeps/{name}.yaml --local
#   python -m fedhpc.report runs/sweeps/{name}
""", f"""name: {name}
config: launch/xormixfl_mnist5k.yaml
base:
  partition: "deficient:0:10:27"
  algo_options.server_epochs: 1
  algo_options.dummy_labels: "1,2,3"
  algo_options.privacy_samples: 200""" + ("" if rule == "average" else f"""
  algo_options.blend_rule: {rule}"""), cells, 10)


if __name__ == "__main__":
    table2(COLUMNS if "--all" in sys.argv else SOME_COLUMNS)
    table3()
    table3("saturating_sum")
