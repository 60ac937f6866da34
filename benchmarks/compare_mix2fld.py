"""Mix2FLD paper Fig. 2 at digits scale: FL, FD, MixFLD, Mix2FLD under both channels and both
data distributions, 3 seeds, from launch/mix2fld_digits.yaml.

Every run goes the full ``--rounds`` (no early stop) so that both figures come from one run:
the reference device's accuracy at the end, and the convergence time, i.e. the simulated
time (``sim_seconds_total``: channel slots + the launch file's compute model, samples processed
times a device's or the server's seconds per sample) of the first round whose global state
changed by less than epsilon (the paper's rule; rounds in which no upload arrived do not
count), with the reference device's accuracy at that round.

The channel's time budget is run under both readings of Sec. II-C: ``half`` (T_max split
equally between uplink and downlink, the text's reading and fedhpc's default) and ``full``
(T_max per direction). Under the launch file's uplink reading (``uplink_bandwidth: dedicated``:
W N_ch per device) FL's upload of this model gets through under either budget (outage 0.0067
asymmetric under ``half``); under the literal FDMA share (``--channel-opt uplink_bandwidth=fdma``)
it gets through under neither (tests/test_channel_reading.py).

    python benchmarks/compare_mix2fld.py [--seeds 0 1 2] [--rounds 20] [--jobs 2] [--out runs/compare_mix2fld]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = ["fl", "fd", "mixfld", "mix2fld"]
PARTITIONS = {"iid": "skewed:0:0:13", "non-iid": "skewed:2:1:13"}
EPSILON = 0.05


def config_for(algo, out_root):
    """launch/mix2fld_digits.yaml for ``algo``: FL and FD take none of the FLD family's options
    (seeds, server training); FD keeps beta."""
    import yaml

    base = yaml.safe_load(open(os.path.join(REPO, "launch", "mix2fld_digits.yaml")))
    base["algo"] = algo
    if algo in ("fl", "fd"):
        base["algo_options"] = {"beta": base["algo_options"]["beta"]} if algo == "fd" else {}
    path = os.path.join(out_root, "configs", f"{algo}.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(base, f)
    return path


def launch(out, config, partition, channel, budget, seed, rounds):
    if os.path.exists(os.path.join(out, "final_model.pt")):
        return out
    args = ["--config", config, "--partition", PARTITIONS[partition], "--channel", channel,
            "--channel-opt", f"direction_budget={budget}", "--seed", str(seed), "--rounds", str(rounds),
            "--stop-epsilon", "0", "--threads", "1", "--quiet", "--no-tensorboard", "--checkpoint-every", "0",
            "--out", out]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    cmd = [sys.executable, "-m", "fedhpc.launch", *args]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return out


def summarise(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    conv = next((r for r in rows if r.get("relative_change", 1.0) < EPSILON), None)
    last = rows[-1]
    return {
        "final_acc": last["reference_device_accuracy"],
        "conv_acc": (conv or last)["reference_device_accuracy"],
        "conv_time": (conv or last)["sim_seconds_total"],
        "converged": conv is not None,
        "up_outage_rate": sum(r["uplink_outages"] for r in rows) / (len(rows) * last["clients"]),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--budgets", nargs="+", default=["half", "full"])
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "compare_mix2fld"))
    a = ap.parse_args()
    grid = list(itertools.product(a.budgets, ["asymmetric", "symmetric"], PARTITIONS, ALGOS, a.seeds))
    configs = {algo: config_for(algo, a.out) for algo in ALGOS}
    with cf.ThreadPoolExecutor(a.jobs) as pool:
        futures = [pool.submit(launch, os.path.join(a.out, f"{budget}-{channel}-{part}-{algo}-s{seed}"),
                               configs[algo], part, channel, budget, seed, a.rounds)
                   for budget, channel, part, algo, seed in grid]
        for f in futures:
            f.result()

    def fmt(xs, scale=100.0):
        return f"{statistics.mean(xs) * scale:.1f} ± {statistics.stdev(xs) * scale:.1f}" if len(xs) > 1 else f"{xs[0] * scale:.1f}"

    print(f"digits twin of Fig. 2: 10 devices, {a.rounds} rounds, seeds {a.seeds}; reference device accuracy (%), "
          f"convergence time (simulated s) at the first round with relative change < {EPSILON}")
    print("| budget | channel | data | algorithm | accuracy at convergence | convergence time (s) | accuracy after "
          f"{a.rounds} rounds | uplink outage rate | runs converged |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for budget, channel, part, algo in itertools.product(a.budgets, ["asymmetric", "symmetric"], PARTITIONS, ALGOS):
        s = [summarise(os.path.join(a.out, f"{budget}-{channel}-{part}-{algo}-s{seed}")) for seed in a.seeds]
        print(f"| {budget} | {channel} | {part} | {algo} | {fmt([x['conv_acc'] for x in s])} | "
              f"{fmt([x['conv_time'] for x in s], 1.0)} | {fmt([x['final_acc'] for x in s])} | "
              f"{statistics.mean(x['up_outage_rate'] for x in s):.2f} | {sum(x['converged'] for x in s)}/{len(s)} |")


if __name__ == "__main__":
    main()
