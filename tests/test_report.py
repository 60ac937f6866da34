"""fedhpc.report on a small local sweep (2 algorithms x 2 seeds on digits): every number is recomputed
here from the metrics files; plus the TensorBoard HParams summaries, read back from the event files."""

import json
import os
import shutil
import statistics

import pytest
import yaml

from fedhpc.report.cli import main as report_main
from fedhpc.sweep.cli import main as sweep_main

REFERENCE = {"paper": "FedMix (ICLR 2021)", "table": "Table 1", "row": "FedProx, CIFAR-10",
             "metric": "test_accuracy", "value": 81.2}


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    grid = root / "g.yaml"
    grid.write_text(yaml.safe_dump({
        "name": "rep", "out": str(root / "sweep"),
        "base": {"rounds": 3, "num_clients": 8, "clients_per_round": 4, "model": "mlp", "lr": 0.1,
                 "quiet": True, "threads": 1},
        "zip": [{"algo": ["fedavg", "fedprox"], "reference": [{}, REFERENCE]}],
        "axes": {"seed": [0, 1]},
    }))
    assert sweep_main([str(grid), "--local"]) == 0
    # One code ran the four runs, as far as the report's tests go: a tree edited while they run
    # (others working in it) would give each run another digest of its changes (run.json's fedhpc).
    runs = sorted((root / "sweep" / "runs").iterdir())
    code = json.loads((runs[0] / "run.json").read_text())["fedhpc"]
    for run in runs[1:]:
        record = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(json.dumps({**record, "fedhpc": code}))
    return root / "sweep"


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _by_algo(sweep_dir):
    out = {}
    for name in sorted(os.listdir(sweep_dir / "runs")):
        run = sweep_dir / "runs" / name
        algo = yaml.safe_load((run / "config.yaml").read_text())["algo"]
        out.setdefault(algo, []).append(_records(run))
    return out


def _cell(values):
    return f"{100 * statistics.mean(values):.2f} ± {100 * statistics.stdev(values):.2f}"


def test_report_numbers_match_the_metrics_files(sweep_dir, tmp_path):
    # An interrupted copy of a run and a failed run: listed, never averaged in.
    extra = tmp_path / "extra"
    first = sorted(os.listdir(sweep_dir / "runs"))[0]
    shutil.copytree(sweep_dir / "runs" / first, extra / "partial")
    lines = (extra / "partial" / "metrics.jsonl").read_text().splitlines()
    (extra / "partial" / "metrics.jsonl").write_text(lines[0] + "\n")
    (extra / "partial" / "final_model.pt").unlink()
    (extra / "failed").mkdir()
    shutil.copy(sweep_dir / "runs" / first / "config.yaml", extra / "failed" / "config.yaml")
    (extra / "failed" / "status.json").write_text(json.dumps({"exit_code": 3}))

    out = tmp_path / "rep"
    assert report_main([str(sweep_dir), str(extra), "--out", str(out), "--target", "0.3"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    md = (out / "report.md").read_text()
    runs = _by_algo(sweep_dir)
    assert [g["settings"]["algo"] for g in summary["groups"]] == ["fedavg", "fedprox"]
    for g in summary["groups"]:
        recs = runs[g["settings"]["algo"]]
        assert g["n"] == 2 and sorted(g["seeds"]) == [0, 1]
        final = [r[-1]["test_accuracy"] for r in recs]
        best = [max(x["test_accuracy"] for x in r) for r in recs]
        local = [r[-1]["local_test_accuracy"] for r in recs]
        assert g["final"]["test_accuracy"]["mean"] == pytest.approx(statistics.mean(final), abs=1e-12)
        assert g["final"]["test_accuracy"]["std"] == pytest.approx(statistics.stdev(final), abs=1e-12)
        assert g["best"]["test_accuracy"]["mean"] == pytest.approx(statistics.mean(best), abs=1e-12)
        assert g["final"]["test_loss"]["mean"] == pytest.approx(statistics.mean(r[-1]["test_loss"] for r in recs))
        assert "local_test_accuracy_std" not in g["best"]  # best only of accuracies, not of their spreads
        mib = statistics.mean(r[-1]["bytes_up_total"] + r[-1]["bytes_down_total"] for r in recs) / 2**20
        hit = [next(x["round"] for x in r if x["test_accuracy"] >= 0.3) for r in recs
               if any(x["test_accuracy"] >= 0.3 for x in r)]
        row = next(l for l in md.splitlines() if l.startswith(f"| {g['row']} | {g['settings']['algo']} | digits | 2 |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[4:9] == [_cell(final), _cell(best), _cell(local),
                              _cell([max(x["local_test_accuracy"] for x in r) for r in recs]),
                              f"{mib:.2f}" if mib >= 1 else f"{mib:.3g}"]
        assert cells[9].endswith(f"({len(hit)}/2)")
        if hit:
            assert cells[9].startswith(f"{statistics.mean(hit):.4g}")
        if g["settings"]["algo"] == "fedprox":
            assert g["reference"] == REFERENCE and cells[10:] == ["81.2", _cell(final)]
            assert g["comparison"]["ours_mean"] == pytest.approx(100 * statistics.mean(final))
        else:
            assert g["reference"] is None and cells[10:] == ["", ""]
    assert "FedMix (ICLR 2021), Table 1, FedProx, CIFAR-10 (final test_accuracy in %)" in md

    excluded = {os.path.basename(e["path"]): e for e in summary["excluded"]}
    assert excluded.keys() == {"partial", "failed"}
    assert excluded["failed"]["status"] == "failed" and excluded["failed"]["exit_code"] == 3
    assert excluded["partial"]["status"] == "interrupted" and excluded["partial"]["last_round"] == 1
    assert "| interrupted (round 1/3) |" in md and "| failed (exit 3, round 0/3) |" in md

    for name in ("accuracy_vs_round", "accuracy_vs_bytes", "accuracy_vs_time", "personalized_accuracy_vs_round"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000
        assert f"({name}.png)" in md
    html = (out / "report.html").read_text()
    assert html.count("<table>") == 3 and "<img src='accuracy_vs_round.png'" in html and "81.2" in html


def test_plotted_curves_are_the_mean_over_seeds(sweep_dir):
    from fedhpc.report.plots import _mib, _rounds, curve
    from fedhpc.report.runs import find_runs, group_runs

    runs, _ = find_runs([str(sweep_dir)])
    groups = group_runs(runs)
    recs = _by_algo(sweep_dir)
    for g in groups:
        mine = recs[g.settings["algo"]]
        xs, mean, std = curve(g, "test_accuracy", _rounds)
        assert list(xs) == [1, 2, 3]
        for i in range(3):
            col = [r[i]["test_accuracy"] for r in mine]
            assert mean[i] == pytest.approx(statistics.mean(col)) and std[i] == pytest.approx(statistics.stdev(col))
        xs, _, _ = curve(g, "test_accuracy", _mib)
        assert xs[-1] == pytest.approx(statistics.mean(r[-1]["bytes_up_total"] + r[-1]["bytes_down_total"]
                                                       for r in mine) / 2**20)


def test_one_seed_has_no_spread_and_empty_folders_are_refused(tmp_path, capsys):
    from fedhpc.report.render import fmt_stat
    from fedhpc.report.summary import Stat

    assert fmt_stat(Stat([0.5]), "test_accuracy") == "50.00"
    assert fmt_stat(Stat([0.5, 0.7]), "test_accuracy") == f"60.00 ± {100 * statistics.stdev([0.5, 0.7]):.2f}"
    assert report_main([str(tmp_path)]) == 2 and "no runs under" in capsys.readouterr().err
    assert report_main([str(tmp_path / "nope")]) == 2 and "is not a folder" in capsys.readouterr().err


def test_hparams_are_readable_from_the_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    from fedhpc.report import write_hparams

    config = {"algo": "fedmix", "lr": 0.05, "rounds": 30, "quiet": True, "local_eval": False, "out": "runs/x",
              "algo_options": {"lam": 0.05, "prox_mu": 0.0}, "data_options": {}, "model_options": {"widths": [1, 2]},
              "reference": {"value": 81.2}, "seed": 3}
    final = {"round": 30, "test_accuracy": 0.91, "test_loss": 0.3, "bytes_up_total": 1e6, "stop": False}
    write_hparams(str(tmp_path), config, final)

    ev = EventAccumulator(str(tmp_path))
    ev.Reload()
    content = ev.PluginTagToContent(metadata.PLUGIN_NAME)
    start = HParamsPluginData.FromString(content[metadata.SESSION_START_INFO_TAG]).session_start_info
    hp = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    assert hp == {"algo": "fedmix", "lr": 0.05, "rounds": 30.0, "seed": 3.0, "local_eval": "false",
                  "algo_options.lam": 0.05, "algo_options.prox_mu": 0.0}
    experiment = HParamsPluginData.FromString(content[metadata.EXPERIMENT_TAG]).experiment
    # the session's metrics are the per-round tags, whose last value is the final one
    assert {m.name.tag for m in experiment.metric_infos} == {"test/accuracy", "test/loss", "comm/bytes_up_total"}
    assert {h.name for h in experiment.hparam_infos} == set(hp)
    for tag, value in (("test/accuracy", 0.91), ("comm/bytes_up_total", 1e6)):
        (s,) = ev.Scalars(tag)
        assert s.step == 30 and s.value == pytest.approx(value)
    # in a run's folder the per-round scalars already hold them: declared, not written again
    write_hparams(str(tmp_path / "run"), config, final, scalars_logged=True)
    ev = EventAccumulator(str(tmp_path / "run"))
    ev.Reload()
    assert ev.Tags()["scalars"] == [] and metadata.EXPERIMENT_TAG in ev.PluginTagToContent(metadata.PLUGIN_NAME)


# ----------------------------------------------------------------------------- bad input: each a reviewer's case

def _copy_runs(sweep_dir, dest, algo="fedavg"):
    """The sweep's runs of ``algo`` copied under ``dest`` (one folder per seed); returns their paths."""
    out = []
    for name in sorted(os.listdir(sweep_dir / "runs")):
        run = sweep_dir / "runs" / name
        if yaml.safe_load((run / "config.yaml").read_text())["algo"] == algo:
            shutil.copytree(run, dest / name)
            out.append(dest / name)
    return out


def _set_last(run, key, value):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[-1])
    rec[key] = value
    (run / "metrics.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(rec)]) + "\n")


def test_one_run_reached_twice_is_one_seed_and_a_differing_twin_is_refused(sweep_dir, tmp_path, capsys):
    first = str(sweep_dir / "runs" / sorted(os.listdir(sweep_dir / "runs"))[0])
    out = tmp_path / "rep"
    # the same folder three times (once with a trailing slash), and a root inside another root
    assert report_main([first, first, first + "/", "--out", str(out)]) == 0
    (g,) = json.loads((out / "summary.json").read_text())["groups"]
    assert g["n"] == 1 and g["final"]["test_accuracy"]["std"] is None
    assert report_main([str(sweep_dir), str(sweep_dir / "runs"), "--out", str(out)]) == 0
    assert [g["n"] for g in json.loads((out / "summary.json").read_text())["groups"]] == [2, 2]

    # two copies of one run under one root: one seed, the copy listed as such and named on stderr
    copies = tmp_path / "copies"
    shutil.copytree(first, copies / "a")
    shutil.copytree(first, copies / "b")
    capsys.readouterr()
    assert report_main([str(copies), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [g["n"] for g in summary["groups"]] == [1]
    (dup,) = summary["excluded"]
    assert dup["path"] == str(copies / "b") and str(copies / "a") in dup["status"]
    assert str(copies / "b") in capsys.readouterr().err

    # the same seed and settings but other results: neither one run nor two seeds
    _set_last(copies / "b", "test_accuracy", 0.123)
    assert report_main([str(copies), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(copies / "a") in err and str(copies / "b") in err
    assert "Traceback" not in err


@pytest.mark.parametrize("bad", [float("nan"), "high"])
def test_a_run_without_a_usable_final_accuracy_is_named_and_the_mean_says_over_how_many(sweep_dir, tmp_path, bad):
    runs = _copy_runs(sweep_dir, tmp_path / "runs")
    _set_last(runs[1], "test_accuracy", bad)
    out = tmp_path / "rep"
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    (g,) = json.loads((out / "summary.json").read_text())["groups"]
    good = _records(runs[0])[-1]["test_accuracy"]
    assert g["n"] == 2 and g["final"]["test_accuracy"]["n"] == 1
    assert g["final"]["test_accuracy"]["mean"] == pytest.approx(good)
    assert g["no_final_value"]["test_accuracy"] == [[str(runs[1]), json.dumps(bad)]]
    md = (out / "report.md").read_text()
    row = next(l for l in md.splitlines() if l.startswith("| 1 | fedavg | digits | 2 |"))
    assert f"| {100 * good:.2f} (over 1 of 2 runs) |" in row
    assert f"| #1 | test_accuracy | {runs[1]} | {json.dumps(bad)} |" in md

    # no run with a usable value: the column stays, empty, instead of vanishing
    _set_last(runs[0], "test_accuracy", bad)
    for run in runs:
        lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "test_accuracy": bad}) + "\n" for r in lines))
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "final acc (%)" in md and "| – (over 0 of 2 runs) |" in md


def test_an_unreadable_config_or_manifest_skips_that_run_and_the_report_counts_it(sweep_dir, tmp_path, capsys):
    copy = tmp_path / "sweep"
    shutil.copytree(sweep_dir, copy)
    broken = copy / "runs" / sorted(os.listdir(copy / "runs"))[0]
    (broken / "config.yaml").write_text((broken / "config.yaml").read_text()[:40] + "\nalgo: [fedavg\n")
    (copy / "sweep.json").write_text('{"points": [')
    out = tmp_path / "rep"
    capsys.readouterr()
    assert report_main([str(copy), "--out", str(out)]) == 0
    streams = capsys.readouterr()
    assert str(broken) in streams.err and str(copy / "sweep.json") in streams.err
    assert "2 skipped as unreadable" in streams.out
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(s["path"] for s in summary["skipped"]) == sorted([str(broken), str(copy / "sweep.json")])
    assert sorted(g["n"] for g in summary["groups"]) == [1, 2]  # the other three runs are still averaged
    md = (out / "report.md").read_text()
    assert "2 skipped as unreadable" in md
    assert f"| {broken} | skipped: {broken}/config.yaml cannot be read as YAML" in md


def test_an_unwritable_out_is_refused_before_reading_runs(sweep_dir, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for out, why in ((afile, "it is a file"), (afile / "sub", "Not a directory")):
        assert report_main([str(sweep_dir), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == f"error: cannot write the report to {out}: {why}; pass --out a folder you can write to " \
                      f"(it is created if missing)\n"
    assert afile.read_text() == "keep me"
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert report_main([str(sweep_dir), "--out", str(ro)]) == 2
        assert "Permission denied" in capsys.readouterr().err
    finally:
        ro.chmod(0o700)


def _set_at(run, index, **values):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[index] = json.dumps({**json.loads(lines[index]), **values})
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_records_with_non_numeric_plot_fields_are_left_out_of_the_plots_and_named(sweep_dir, tmp_path):
    runs = _copy_runs(sweep_dir, tmp_path / "runs")
    _set_at(runs[0], 0, round="one")                      # a round that is not a number
    _set_at(runs[0], 1, bytes_up_total=None)              # an x axis field of null
    _set_at(runs[1], 1, test_accuracy="high", round_seconds="slow")
    out = tmp_path / "rep"
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["left_out_of_plots"] == [
        {"path": str(runs[0]), "field": "bytes_up_total", "holds": "null", "records": 1},
        {"path": str(runs[0]), "field": "round", "holds": '"one"', "records": 1},
        {"path": str(runs[1]), "field": "round_seconds", "holds": '"slow"', "records": 1},
        {"path": str(runs[1]), "field": "test_accuracy", "holds": '"high"', "records": 1}]
    md = (out / "report.md").read_text()
    assert "Records left out of the plots" in md and f"| {runs[0]} | round | \"one\" | 1 |" in md
    for name in ("accuracy_vs_round", "accuracy_vs_bytes", "accuracy_vs_time", "personalized_accuracy_vs_round"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from fedhpc.report.plots import _mib, _rounds, curve
    from fedhpc.report.runs import find_runs, group_runs
    (g,) = group_runs(find_runs([str(tmp_path / "runs")])[0])
    xs, mean, _ = curve(g, "test_accuracy", _rounds)
    assert list(xs) == [3]  # round 1 is unusable in one run, round 2 in the other: only 3 is common
    assert mean[0] == pytest.approx(statistics.mean(_records(r)[2]["test_accuracy"] for r in runs))
    left_out = set()
    assert list(curve(g, "test_accuracy", _mib, left_out)[0]) == pytest.approx(
        [statistics.mean(_records(r)[2]["bytes_up_total"] + _records(r)[2]["bytes_down_total"] for r in runs) / 2**20])
    assert {(p, f) for p, f, _, _ in left_out} == {(str(runs[0]), "round"), (str(runs[0]), "bytes_up_total"),
                                                   (str(runs[1]), "test_accuracy")}


def test_the_default_title_names_each_root_once_and_at_most_three(sweep_dir, tmp_path):
    first = str(sweep_dir / "runs" / sorted(os.listdir(sweep_dir / "runs"))[0])
    out = tmp_path / "rep"
    assert report_main([first, first, first + "/", "--out", str(out)]) == 0
    assert (out / "report.md").read_text().splitlines()[0] == f"# fedhpc report: {first}"
    roots = [str(sweep_dir / "runs" / name) for name in sorted(os.listdir(sweep_dir / "runs"))]
    assert report_main(roots + [roots[0], "--out", str(out)]) == 0
    assert (out / "report.md").read_text().splitlines()[0] == \
        f"# fedhpc report: {roots[0]}, {roots[1]}, {roots[2]} and {len(roots) - 3} more"


def test_a_target_reached_in_a_record_without_a_readable_round_is_named_not_moved(sweep_dir, tmp_path):
    runs = _copy_runs(sweep_dir, tmp_path / "runs")
    first_accuracy = _records(runs[0])[0]["test_accuracy"]
    _set_at(runs[0], 0, round="one")  # the record in which the target is first reached
    from fedhpc.report.runs import find_runs, group_runs
    from fedhpc.report.summary import time_to_target
    (g,) = group_runs(find_runs([str(tmp_path / "runs")])[0])
    t = time_to_target(g, first_accuracy - 1e-9)
    assert t["unreadable"] == [str(runs[0])]
    # the other runs are counted as they reach it; runs[0] is not reported at a later round
    reached = [next(rec["round"] for rec in _records(r) if rec["test_accuracy"] >= first_accuracy - 1e-9)
               for r in runs[1:] if any(rec["test_accuracy"] >= first_accuracy - 1e-9 for rec in _records(r))]
    assert (t["reached"], t["of"]) == (len(reached), len(runs) - 1)
    assert t["round"].mean == pytest.approx(statistics.mean(reached))
    out = tmp_path / "rep"
    assert report_main([str(tmp_path / "runs"), "--out", str(out), "--target", str(first_accuracy - 1e-9)]) == 0
    assert "1 unreadable" in (out / "report.md").read_text()


def test_runs_spelling_one_setting_differently_are_one_group(sweep_dir, tmp_path):
    """An option written as 1 in a YAML file and parsed as 1.0 from --mu, an option written out at
    its default, an alias and a partition spelled another way: the same computation, one group of
    two seeds (the engine would resume one as the other)."""
    a, b = _copy_runs(sweep_dir, tmp_path / "runs", algo="fedprox")
    for run, changes in ((a, {"algo_options": {"mu": 1.0}, "partition": "dirichlet:0.5"}),
                         (b, {"algo": "FedProx", "algo_options": {"mu": 1}, "partition": "Dirichlet:.50"})):
        config = yaml.safe_load((run / "config.yaml").read_text())
        config.update(changes)
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "rep"
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert [g["n"] for g in json.loads((out / "summary.json").read_text())["groups"]] == [2]
    # a default written out is no setting: {} and the default value are one group too, and a
    # value that differs still makes its own group
    from fedhpc.algorithms import ALGORITHMS
    default_mu = ALGORITHMS.get("fedprox").Options().mu
    for run, mu in ((a, default_mu), (b, None)):
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["algo_options"] = {} if mu is None else {"mu": mu}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert [g["n"] for g in json.loads((out / "summary.json").read_text())["groups"]] == [2]
    config = yaml.safe_load((a / "config.yaml").read_text())
    config["algo_options"] = {"mu": default_mu * 2 + 1}
    (a / "config.yaml").write_text(yaml.safe_dump(config))
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert [g["n"] for g in json.loads((out / "summary.json").read_text())["groups"]] == [1, 1]


def test_runs_are_read_with_the_option_defaults_of_the_code_that_made_them(sweep_dir, tmp_path):
    """config.yaml holds options as given ({} for FedProx's mu at its default); the engine records
    beside the identity every option as it read them. A run made when mu's default was another
    value (its record says so) is not a seed of today's default: its own group, mu named. Without
    the record (runs from before it), today's defaults are all there is."""
    from fedhpc.algorithms import ALGORITHMS
    from fedhpc.checkpoint import OPTIONS_AS_RUN

    a, b = _copy_runs(sweep_dir, tmp_path / "runs", algo="fedprox")
    today = ALGORITHMS.get("fedprox").Options().mu
    records = {run: json.loads((run / "identity.json").read_text()) for run in (a, b)}
    assert all(r["algo_options"] == {} and r[OPTIONS_AS_RUN]["algo_options"]["mu"] == today for r in records.values())
    out = tmp_path / "rep"
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert [g["n"] for g in json.loads((out / "summary.json").read_text())["groups"]] == [2]
    then = records[a]
    then[OPTIONS_AS_RUN]["algo_options"]["mu"] = today * 2 + 1  # what older code would have recorded
    (a / "identity.json").write_text(json.dumps(then))
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    groups = json.loads((out / "summary.json").read_text())["groups"]
    assert sorted(g["n"] for g in groups) == [1, 1]
    assert sorted(str(g["settings"].get("algo_options.mu")) for g in groups) == sorted(["None", str(today * 2 + 1)])
    # a config.yaml edited since (its options no longer those the record was made for) is read as it stands
    config = yaml.safe_load((a / "config.yaml").read_text())
    (a / "config.yaml").write_text(yaml.safe_dump({**config, "algo_options": {"mu": today}}))
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert [g["n"] for g in json.loads((out / "summary.json").read_text())["groups"]] == [2]


def test_a_split_dealt_under_other_partition_rules_is_its_own_group(sweep_dir, tmp_path, capsys):
    """config.yaml cannot say which partition rules dealt a run's split; the identity the engine
    records (identity.json, else the last checkpoint's) can. A run of older rules is not a seed of
    today's group, and the column says why; one whose identity.json is broken is skipped and named."""
    a, b = _copy_runs(sweep_dir, tmp_path / "runs")
    assert json.loads((a / "identity.json").read_text())["partition_rules"] == 2  # the engine wrote it
    out = tmp_path / "rep"
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert [g["n"] for g in json.loads((out / "summary.json").read_text())["groups"]] == [2]
    ident = json.loads((a / "identity.json").read_text())
    (a / "identity.json").write_text(json.dumps({**ident, "partition_rules": 1}))
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    groups = json.loads((out / "summary.json").read_text())["groups"]
    assert sorted((g["n"], str(g["settings"].get("partition_rules"))) for g in groups) == [(1, "1"), (1, "None")]
    assert "partition_rules" in (out / "report.md").read_text()
    # a run recorded before the identity held the rules, read from its last checkpoint when the
    # engine wrote no identity.json: also not today's
    del ident["partition_rules"]
    (a / "identity.json").write_text(json.dumps(ident))
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    groups = json.loads((out / "summary.json").read_text())["groups"]
    assert sorted(str(g["settings"].get("partition_rules")) for g in groups) == ["None", "unrecorded"]
    (a / "identity.json").unlink()  # a run from before identity.json: its checkpoint holds rules 2
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert [g["n"] for g in json.loads((out / "summary.json").read_text())["groups"]] == [2]
    (a / "identity.json").write_text("{torn")
    capsys.readouterr()
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert [g["n"] for g in json.loads((out / "summary.json").read_text())["groups"]] == [1]
    assert "identity.json" in capsys.readouterr().err


def test_best_local_accuracy_skips_the_rounds_that_evaluated_a_sample_of_clients():
    """--local-eval-clients: a round's local accuracy over a sample of clients is an estimate, and
    the maximum over noisy estimates is biased up; best takes the rounds that covered every client."""
    from fedhpc.report.runs import Group, Run
    from fedhpc.report.summary import best_stats, metric_names

    records = [{"round": 1, "test_accuracy": 0.5, "local_test_accuracy": 0.6, "local_test_accuracy_mean": 0.61},
               {"round": 2, "test_accuracy": 0.7, "local_test_accuracy": 0.9, "local_test_accuracy_mean": 0.95,
                "local_eval_clients": 3},
               {"round": 3, "test_accuracy": 0.6, "local_test_accuracy": 0.8, "local_test_accuracy_mean": 0.81}]
    group = Group(settings={}, runs=[Run(path="r", config=None, records=records, state=None)])
    names = metric_names([group])
    assert "local_eval_clients" not in names  # bookkeeping, like the round's client count
    best = best_stats(group, names)
    assert best["test_accuracy"].values == [0.7]  # the global test set: every round counts
    assert best["local_test_accuracy"].values == [0.8]
    # the clients' mean accuracy too: a paper row at its best round (pMixFed's FedAlt / FedSim) has
    # a number to stand beside
    assert best["local_test_accuracy_mean"].values == [0.81]
    assert "local_test_accuracy_std" not in best  # a spread is no accuracy


def test_plots_mark_sampled_local_rounds_hollow_and_draw_the_reference_device_against_time(tmp_path, monkeypatch):
    """The clients' plot draws rounds that evaluated a sample of clients with hollow markers (at
    those rounds only); runs with a reference device get its accuracy against the simulated clock
    (Mix2FLD's Fig. 2), at the mean over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedhpc.report.plots import plot_groups
    from fedhpc.report.runs import Group, Run

    def rec(t, local, ref, sim, sampled=False):
        r = {"round": t, "test_accuracy": 0.5, "local_test_accuracy": local, "reference_device_accuracy": ref,
             "sim_seconds_total": sim}
        return {**r, "local_eval_clients": 3} if sampled else r

    runs = [Run(path=f"r{s}", config=None, state=None,
                records=[rec(1, 0.2, 0.1 + 0.2 * s, 1.0 + s), rec(2, 0.4, 0.3, 2.0, sampled=True), rec(3, 0.6, 0.5, 3.0)])
            for s in (0, 1)]
    axes = {}
    subplots = plt.subplots

    def spy(*a, **k):
        fig, ax = subplots(*a, **k)
        axes[len(axes)] = ax
        return fig, ax

    monkeypatch.setattr(plt, "subplots", spy)
    written = plot_groups([Group(settings={"algo": "fd"}, runs=runs)], ["fd"], str(tmp_path))
    names = list(written)
    assert names[-2:] == ["personalized_accuracy_vs_round", "reference_device_accuracy_vs_time"]
    local, ref = axes[len(names) - 2], axes[len(names) - 1]
    hollow = [l for l in local.lines if l.get_markerfacecolor() == "white"]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [2.0] and list(hollow[0].get_ydata()) == [40.0]
    assert "--local-eval-clients" in local.get_title()
    line, = ref.lines
    assert list(line.get_xdata()) == [1.5, 2.0, 3.0] and list(line.get_ydata()) == pytest.approx([20.0, 30.0, 50.0])
    for name in names:
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_target_of_another_accuracy_skips_sampled_rounds_and_says_where_it_is_not_logged(sweep_dir, tmp_path,
                                                                                            capsys):
    """--target-metric: the round at which that accuracy first reaches --target; a round that
    evaluated a sample of the clients does not count (as for best); runs that do not log the metric
    (FD has no test_accuracy) are "not logged", not "never"; a metric no run logs is refused."""
    runs = _copy_runs(sweep_dir, tmp_path / "runs")
    for run, values in zip(runs, ([0.95, 0.5, 0.93], [0.2, 0.91, 0.99])):
        for i, v in enumerate(values):
            _set_at(run, i, local_test_accuracy_mean=v)
    _set_at(runs[0], 0, local_eval_clients=3)  # round 1's 0.95 is over a sample of the clients
    out = tmp_path / "rep"
    args = [str(tmp_path / "runs"), "--out", str(out), "--target", "0.9"]
    assert report_main(args + ["--target-metric", "local_test_accuracy_mean"]) == 0
    (group,) = json.loads((out / "summary.json").read_text())["groups"]
    assert group["target"]["metric"] == "local_test_accuracy_mean" and group["target"]["round"]["values"] == [3, 2]
    assert "| round to 90% local_test_accuracy_mean |" in (out / "report.md").read_text()

    for run in runs:  # as FD's rows: no global model, no test_accuracy
        rows = [{k: v for k, v in r.items() if k not in ("test_accuracy", "test_loss")} for r in _records(run)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report_main(args + ["--target-metric", "reference_device_accuracy"]) == 2
    assert capsys.readouterr().err == ("error: --target-metric reference_device_accuracy: no run here logs it; "
                                       "accuracies they log: local_test_accuracy, local_test_accuracy_mean, "
                                       "local_test_accuracy_worst10\n")
    extra = tmp_path / "runs" / "with_test_accuracy"
    shutil.copytree(sweep_dir / "runs" / sorted(os.listdir(sweep_dir / "runs"))[-1], extra)
    assert report_main(args) == 0
    fd_like, logged = (next(line for line in (out / "report.md").read_text().splitlines()
                            if line.startswith("| ") and f"| {algo} |" in line) for algo in ("fedavg", "fedprox"))
    assert "| – (not logged) |" in fd_like and "| never (0/1) |" in logged, (fd_like, logged)


# ----------------------------------------------------------------------------- provenance: code, resolved settings

def _edit(run, name, change):
    path = run / name
    if name.endswith(".json"):
        path.write_text(json.dumps(change(json.loads(path.read_text()))))
    else:
        path.write_text(yaml.safe_dump(change(yaml.safe_load(path.read_text()))))


def _rows(out):
    """report.md's main table: {first setting cells joined: row cells}, and the header."""
    lines = [l for l in (out / "report.md").read_text().splitlines() if l.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return header, [[c.strip() for c in l.strip("|").split("|")] for l in lines[1:]
                    if l.split("|")[1].strip().isdigit()]


def test_rows_name_each_value_a_setting_takes_also_where_it_is_the_default(sweep_dir, tmp_path):
    """FedProx at the default mu beside FedProx at another mu: both rows and both legends name mu (the
    default's row read "fedprox" with a blank before); FedAvg, which has no mu, shows "-"."""
    from fedhpc.algorithms import ALGORITHMS, load_algorithm_modules
    from fedhpc.report.build import _label
    from fedhpc.report.runs import find_runs, group_runs

    load_algorithm_modules()
    default_mu = ALGORITHMS.get("fedprox").Options().mu
    for run in _copy_runs(sweep_dir, tmp_path / "other_mu", algo="fedprox"):
        _edit(run, "config.yaml", lambda c: {**c, "algo_options": {"mu": default_mu * 10}})
    out = tmp_path / "rep"
    assert report_main([str(sweep_dir), str(tmp_path / "other_mu"), "--out", str(out)]) == 0
    header, rows = _rows(out)
    assert header[:4] == ["#", "algo", "dataset", "algo_options.mu"]
    assert [r[1:4] for r in rows] == [["fedavg", "digits", "-"], ["fedprox", "digits", str(default_mu)],
                                      ["fedprox", "digits", str(default_mu * 10)]]
    summary = json.loads((out / "summary.json").read_text())
    assert [g["label"] for g in summary["groups"]] == [
        "algo=fedavg", f"algo=fedprox, algo_options.mu={default_mu}",
        f"algo=fedprox, algo_options.mu={default_mu * 10}"]
    groups = group_runs(find_runs([str(sweep_dir), str(tmp_path / "other_mu")])[0])
    assert [_label(g, ["algo", "algo_options.mu"]) for g in groups] == [g["label"] for g in summary["groups"]]
    # one value everywhere, set by nobody and varied by no sweep: not a column (an option of one method
    # beside another's is no difference either: FedAvg's server_lr beside FedProx)
    assert report_main([str(sweep_dir), "--out", str(out)]) == 0
    header, rows = _rows(out)
    assert header[:4] == ["#", "algo", "dataset", "seeds"] and [r[1] for r in rows] == ["fedavg", "fedprox"]


def test_the_axes_a_sweep_declares_are_named_in_every_row(sweep_dir, tmp_path):
    """A grid whose zip pairs FedAvg with FedProx at mu 0.01 (the default) declares mu an axis: named
    in the rows and legends although it takes one value."""
    copy = tmp_path / "sweep"
    shutil.copytree(sweep_dir, copy, ignore=shutil.ignore_patterns("report"))
    manifest = json.loads((copy / "sweep.json").read_text())
    for p in manifest["points"]:
        algo = yaml.safe_load((copy / "runs" / p["id"] / "config.yaml").read_text())["algo"]
        p["axes"]["algo_options.mu"] = None if algo == "fedavg" else 0.01
    (copy / "sweep.json").write_text(json.dumps(manifest))
    out = tmp_path / "rep"
    assert report_main([str(copy), "--out", str(out)]) == 0
    header, rows = _rows(out)
    assert header[:4] == ["#", "algo", "dataset", "algo_options.mu"] and [r[3] for r in rows] == ["-", "0.01"]
    assert [g["label"] for g in json.loads((out / "summary.json").read_text())["groups"]] == [
        "algo=fedavg", "algo=fedprox, algo_options.mu=0.01"]


def test_settings_left_at_auto_are_read_as_the_run_resolved_them(sweep_dir, tmp_path):
    """The partition the sweep left at auto is the iid split run.json records, and a model left at
    auto the one the run built: a run naming them is the same computation (one seed counted once),
    and rows show the resolved values. A run from before run.json reads auto as today's code deals
    the partition and as the other runs here resolved the model on its dataset; alone, its model
    stays config.yaml's auto."""
    runs = _copy_runs(sweep_dir, tmp_path / "auto")
    named = _copy_runs(sweep_dir, tmp_path / "named")
    assert all(yaml.safe_load((r / "config.yaml").read_text())["partition"] == "auto" for r in runs)
    assert json.loads((runs[0] / "run.json").read_text())["config"]["partition"] == "iid"
    for run in runs:  # as if the sweep had left the model at auto (run.json records what was built: mlp)
        _edit(run, "config.yaml", lambda c: {**c, "model": "auto"})
    for run in named:
        _edit(run, "config.yaml", lambda c: {**c, "partition": "iid"})
    (runs[1] / "run.json").unlink()  # a run from before run.json
    out = tmp_path / "rep"
    assert report_main([str(tmp_path / "auto"), str(tmp_path / "named"), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [(g["n"], g["settings"]["partition"], g["settings"]["model"])
            for g in summary["groups"]] == [(2, "iid", "mlp")]
    assert {os.path.dirname(e["path"]) for e in summary["excluded"]} == {str(tmp_path / "named")}  # duplicates
    shared = next(l for l in (out / "report.md").read_text().splitlines() if l.startswith("Settings shared by"))
    assert "partition=iid" in shared and "model=mlp" in shared and "=auto" not in shared

    assert report_main([str(runs[1]), "--out", str(out)]) == 0  # nothing here says what its auto model was
    (group,) = json.loads((out / "summary.json").read_text())["groups"]
    assert group["settings"]["model"] == "auto" and group["settings"]["partition"] == "iid"

    from fedhpc.report import load_runs
    rows = {os.path.basename(r["path"]): r for r in load_runs(str(tmp_path / "auto"), as_frame=False)}
    resolved = rows[runs[0].name]
    assert (resolved["partition"], resolved["model"], resolved["device"], resolved["threads"]) == (
        "iid", "mlp", "cpu", 1)
    assert resolved["fedhpc_version"] and resolved["commit"] == json.loads(
        (runs[0] / "run.json").read_text())["fedhpc"]["commit"]
    old = rows[runs[1].name]
    assert (old["partition"], old["model"], old["device"], old["fedhpc_version"]) == ("iid", "mlp", "auto", None)


def test_rows_averaging_runs_of_different_code_are_warned_about_and_named(sweep_dir, tmp_path, capsys):
    """Two seeds of one row run by different commits, or one from a dirty tree: the row's spread may be
    the code's. The report warns on stderr and in report.md, naming each run and its code; runs of
    one code are not warned about."""
    a, b = _copy_runs(sweep_dir, tmp_path / "runs")
    out = tmp_path / "rep"
    capsys.readouterr()
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert "different fedhpc code" not in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["groups"][0]["code_versions"] is None
    assert "different fedhpc code" not in (out / "report.md").read_text()

    same = json.loads((a / "run.json").read_text())["fedhpc"]
    for change in ({"commit": "0123456789abcdef0123", "dirty": False, "diff_sha1": None},
                   {"dirty": not same["dirty"], "diff_sha1": None if same["dirty"] else "feedc0de" * 5},
                   {"dirty": True, "diff_sha1": "feedc0de" * 5} if not same["dirty"] else
                   {"diff_sha1": "feedc0de" * 5}):
        _edit(b, "run.json", lambda r: {**r, "fedhpc": {**same, **change}})
        assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0, change
        err = capsys.readouterr().err
        (group,) = json.loads((out / "summary.json").read_text())["groups"]
        assert group["n"] == 2 and set(group["code_versions"]) == {str(a), str(b)}, change
        assert group["code_versions"][str(a)] != group["code_versions"][str(b)]
        assert "row #1 (algo=fedavg) averages runs of different fedhpc code" in err
        assert str(a) in err and str(b) in err and group["code_versions"][str(b)][0] in err
        md = (out / "report.md").read_text()
        assert "different fedhpc code" in md and f"| #1 | {b} | {group['code_versions'][str(b)][0]} |" in md

    # a run resumed under other code is one of two codes itself
    _edit(b, "run.json", lambda r: {**r, "fedhpc": same,
                                    "earlier_launches": [{"fedhpc": {**same, "commit": "ab" * 20}}]})
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    (group,) = json.loads((out / "summary.json").read_text())["groups"]
    assert group["code_versions"][str(b)][0].split()[1] == "ab" * 6 and len(group["code_versions"][str(b)]) == 2
    # a run from before run.json beside one with it: its code cannot be told to be the same
    (b / "run.json").unlink()
    assert report_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    (group,) = json.loads((out / "summary.json").read_text())["groups"]
    assert group["code_versions"][str(b)] == ["unrecorded"]


def test_every_run_of_a_sweep_declares_every_swept_setting_as_an_hparams_column(sweep_dir):
    """TensorBoard's HParams tab takes its columns from one experiment summary: each run of the sweep
    declares the sweep's, so FedProx's mu is a column whichever run the tab reads (FedAvg has none),
    and settings of where or how a run executed are not; each session holds its resolved values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    from fedhpc.algorithms import ALGORITHMS, load_algorithm_modules

    load_algorithm_modules()
    declared = json.loads((sweep_dir / "sweep.json").read_text())["hparams"]
    assert declared["algo_options.mu"] == "number" and declared["algo"] == "string"
    columns, sessions = [], {}
    for name in sorted(os.listdir(sweep_dir / "runs")):
        ev = EventAccumulator(str(sweep_dir / "runs" / name / "tensorboard"))
        ev.Reload()
        content = ev.PluginTagToContent(metadata.PLUGIN_NAME)
        experiment = HParamsPluginData.FromString(content[metadata.EXPERIMENT_TAG]).experiment
        columns.append({h.name for h in experiment.hparam_infos})
        start = HParamsPluginData.FromString(content[metadata.SESSION_START_INFO_TAG]).session_start_info
        hp = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
        sessions.setdefault(hp["algo"], []).append(hp)
        assert {m.name.tag for m in experiment.metric_infos} >= {"test/accuracy", "train/loss"}
    assert len(columns) == 4 and all(c == columns[0] for c in columns)
    assert {"algo", "lr", "seed", "partition", "model", "algo_options.mu", "algo_options.server_lr"} <= columns[0]
    assert columns[0] >= set(declared)
    assert not columns[0] & {"data_dir", "threads", "collective_timeout", "client_state_budget_mb",
                             "eval_batch_size", "device", "out", "checkpoint_every", "data_options.store"}
    assert not any(c.startswith("channel_options.") for c in columns[0])  # no channel in these runs
    for hp in sessions["fedprox"]:
        assert hp["algo_options.mu"] == ALGORITHMS.get("fedprox").Options().mu  # the default, as run
        assert hp["partition"] == "iid" and hp["model"] == "mlp"  # resolved: the sweep left partition at auto
    assert all("algo_options.mu" not in hp for hp in sessions["fedavg"])
