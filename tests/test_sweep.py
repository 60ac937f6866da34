"""fedhpc.sweep: grid expansion (products, zips, stable ids), refusal of bad grids, and a local
sweep that skips finished points, resumes an interrupted one and records a failed one."""

import itertools
import json

import pytest
import torch
import yaml

from fedhpc.errors import ConfigError
from fedhpc.sweep import expand, load_grid, run_state
from fedhpc.sweep.cli import main as sweep_main
from fedhpc.sweep.grid import point_yaml, run_hash

TINY = {"num_clients": 8, "clients_per_round": 4, "model": "mlp", "quiet": True, "threads": 1,
        "tensorboard": False, "rounds": 3, "checkpoint_every": 1}


def write_grid(tmp_path, grid: dict, name="g.yaml") -> str:
    grid.setdefault("out", str(tmp_path / "sweep"))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return str(path)


def test_product_times_zip_enumerates_every_combination_once(tmp_path):
    path = write_grid(tmp_path, {
        "base": {"rounds": 2, "model": "mlp"},
        "zip": [{"algo": ["fedavg", "fedprox"], "lr": [0.05, 0.1]}],
        "axes": {"seed": [0, 1, 2], "batch_size": [10, 20]},
    })
    points = expand(load_grid(path))
    expected = [{"algo": a, "lr": lr, "seed": s, "batch_size": b}
                for (a, lr), s, b in itertools.product([("fedavg", 0.05), ("fedprox", 0.1)], [0, 1, 2], [10, 20])]
    assert [p.axes for p in points] == expected  # zip outermost, last axis fastest
    assert [p.index for p in points] == list(range(12))
    for p, e in zip(points, expected):
        assert p.settings == {"rounds": 2, "model": "mlp", **e}
        assert p.rounds == 2
    assert points[0].label == "algo-fedavg_lr-0.05_seed-0_batch_size-10"
    assert len({p.id for p in points}) == 12


def test_ids_are_stable_and_depend_only_on_the_point(tmp_path):
    grid = {"base": {"rounds": 2}, "axes": {"algo": ["fedavg", "fedprox"], "seed": [0, 1]}}
    ids = {tuple(p.axes.values()): p.id for p in expand(load_grid(write_grid(tmp_path, dict(grid))))}
    assert ids == {tuple(p.axes.values()): p.id for p in expand(load_grid(write_grid(tmp_path, dict(grid))))}
    # More seeds, values in another order, more rounds: the old points keep their ids.
    grown = {"base": {"rounds": 50}, "axes": {"algo": ["fedprox", "fedavg"], "seed": [2, 1, 0]}}
    ids2 = {tuple(p.axes.values()): p.id for p in expand(load_grid(write_grid(tmp_path, grown)))}
    assert all(ids2[k] == v for k, v in ids.items()) and len(ids2) == 6
    # A setting that changes what is computed changes every id.
    other = {"base": {"rounds": 2, "lr": 0.2}, "axes": grid["axes"]}
    ids3 = {tuple(p.axes.values()): p.id for p in expand(load_grid(write_grid(tmp_path, other)))}
    assert not set(ids3.values()) & set(ids.values())
    # The hash is SHA-1 over the identity settings as written, recomputed here independently.
    import hashlib
    p = expand(load_grid(write_grid(tmp_path, dict(grid))))[3]
    blob = json.dumps({"algo": "fedprox", "seed": 1}, sort_keys=True, separators=(",", ":"))
    assert p.id == "algo-fedprox_seed-1-" + hashlib.sha1(blob.encode()).hexdigest()[:8] == f"{p.label}-{run_hash(p.settings)}"


def test_config_file_base_and_axes_merge_in_that_order(tmp_path):
    launch_file = tmp_path / "l.yaml"
    launch_file.write_text(yaml.safe_dump({"algo": "fedmix", "rounds": 100, "lr": 0.05,
                                           "algo_options": {"lam": 0.05, "prox_mu": 0.0}}))
    path = write_grid(tmp_path, {
        "config": str(launch_file), "base": {"rounds": 4, "model": "mlp"},
        "zip": [{"algo": ["fedavg", "fedmix"], "algo_options.lam": [None, 0.2], "algo_options.prox_mu": [None, 0.1]}],
    })
    fedavg, fedmix = expand(load_grid(path))
    assert fedavg.settings == {"algo": "fedavg", "rounds": 4, "lr": 0.05, "algo_options": {}, "model": "mlp"}
    assert fedmix.settings["algo_options"] == {"lam": 0.2, "prox_mu": 0.1} and fedmix.settings["rounds"] == 4
    assert fedmix.label == "algo-fedmix_lam-0.2_prox_mu-0.1" and fedavg.label == "algo-fedavg"
    assert yaml.safe_load(point_yaml(load_grid(path), fedmix)) == fedmix.settings
    # A mapping in base is merged into the file's, key by key, not put in its place.
    path = write_grid(tmp_path, {"config": str(launch_file), "base": {"algo_options": {"prox_mu": 0.1}}}, "g2.yaml")
    (only,) = expand(load_grid(path))
    assert only.settings["algo_options"] == {"lam": 0.05, "prox_mu": 0.1} and only.label == "run"


@pytest.mark.parametrize("grid, words", [
    ({"axis": {"seed": [0]}}, "unknown top-level key"),
    ({"axes": {"sed": [0, 1]}}, "did you mean 'seed'"),
    ({"axes": {"seed": []}}, "'seed' is empty"),
    ({"axes": {"seed": 3}}, "must be a list"),
    ({"zip": [{"algo": ["fedavg", "fedprox"], "lr": [0.1]}]}, "different lengths"),
    ({"axes": {"seed": [0]}, "zip": [{"seed": [1]}]}, "more than one"),
    ({"base": {"out": "x"}}, "sweep chooses"),
    ({"base": {"colour_options.x": 1}}, "dotted keys"),
    ({"ranks": 0}, "ranks"),
    ({"slurm": {"gpus": 1}}, "no option"),
    ({"ranks": 3, "slurm": {"nodes": 2}}, "multiple of slurm.nodes"),
])
def test_bad_grids_are_refused_before_anything_is_written(tmp_path, capsys, grid, words):
    path = write_grid(tmp_path, grid)
    assert sweep_main([path, "--local"]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


def test_points_failing_validation_are_named(tmp_path, capsys):
    path = write_grid(tmp_path, {"base": TINY, "axes": {"lr": [0.1, -1.0], "clients_per_round": [4, 99]}})
    with pytest.raises(ConfigError) as e:
        expand(load_grid(path))
    msg = str(e.value)
    assert "3 of 4 point(s)" in msg and "point 0" not in msg
    assert "point 1 (lr-0.1_clients_per_round-99): --clients-per-round" in msg
    assert "point 2 (lr--1.0_clients_per_round-4): --lr must be a positive number" in msg
    assert sweep_main([path]) == 2 and "point 3" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    path = write_grid(tmp_path, {"base": TINY, "axes": {"seed": [0, 1]}, "ranks": 2})
    assert sweep_main([path, "--local", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would run: ") == 2 and out.count(" -n 2 ") == 2 and "--resume" in out
    assert sweep_main([path, "--dry-run", "--max-parallel", "1"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-1%1" in out and "#SBATCH --ntasks-per-node=2" in out
    assert not (tmp_path / "sweep").exists()


def test_slurm_mode_without_sbatch_says_what_to_do(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    path = write_grid(tmp_path, {"base": TINY, "axes": {"seed": [0]}})
    assert sweep_main([path]) == 2
    err = capsys.readouterr().err
    assert "sbatch is not on PATH" in err and "--local" in err
    assert sweep_main([path, "--no-submit"]) == 0
    script = (tmp_path / "sweep" / "slurm" / "array-1.sbatch").read_text()
    assert "#SBATCH --array=0-0" in script and "step.sh" in script


def _run_in_process(yaml_path, run_dir, *extra):
    from fedhpc.launch import main as launch_main
    assert launch_main(["--config", yaml_path, "--out", run_dir, "--resume", *extra]) == 0


def test_local_sweep_skips_finished_resumes_interrupted_and_records_failures(tmp_path, capsys):
    torch.set_num_threads(1)
    empty = tmp_path / "no_data"
    empty.mkdir()
    path = write_grid(tmp_path, {"base": {**TINY, "data_dir": str(empty)},
                                 "zip": [{"seed": [0, 1, 2, 3], "dataset": ["digits"] * 3 + ["mnist"]}]})
    grid = load_grid(path)
    p0, p1, p2, p3 = expand(grid)
    runs = tmp_path / "sweep" / "runs"
    for p in (p0, p1):
        f = tmp_path / f"{p.id}.yaml"
        f.write_text(point_yaml(grid, p))
        # point 0 finished before the sweep; point 1 stopped after its first round
        _run_in_process(str(f), str(runs / p.id), *(["--rounds", "1"] if p is p1 else []))
    final0 = runs / p0.id / "final_model.pt"
    before0 = (final0.stat().st_mtime_ns, (runs / p0.id / "metrics.jsonl").read_text())
    first1 = json.loads((runs / p1.id / "metrics.jsonl").read_text().splitlines()[0])
    assert run_state(str(runs / p1.id), 3).status == "interrupted"
    capsys.readouterr()

    assert sweep_main([path, "--local"]) == 1  # one point fails: reported, the others still run
    out = capsys.readouterr().out
    assert f"{p0.id}: finished (round 3/3) -> skip" in out
    assert f"{p1.id}: interrupted (round 1/3) -> resume" in out and "resuming after round 1" in out
    assert "FAILED (exit 2)" in out and p3.id in out
    # finished point untouched, never launched
    assert (final0.stat().st_mtime_ns, (runs / p0.id / "metrics.jsonl").read_text()) == before0
    assert not (tmp_path / "sweep" / "logs" / f"{p0.id}.log").exists()
    # interrupted point resumed from its checkpoint: round 1 is the same record (timings included)
    recs1 = [json.loads(l) for l in (runs / p1.id / "metrics.jsonl").read_text().splitlines()]
    # round 1 was the 1-round run's last; now an ordinary one, evaluated again (its own eval_seconds)
    assert [r["round"] for r in recs1] == [1, 2, 3] and recs1[0]["eval_seconds"] > 0
    assert {**recs1[0], "eval_seconds": None} == {**first1, "eval_seconds": None}
    assert "resumed from" in (tmp_path / "sweep" / "logs" / f"{p1.id}.log").read_text()
    for p in (p0, p1, p2):
        assert run_state(str(runs / p.id), 3).status == "finished"
    failed = run_state(str(runs / p3.id), 3)
    assert failed.status == "failed" and failed.exit_code == 2
    assert "mnist" in (tmp_path / "sweep" / "logs" / f"{p3.id}.log").read_text().lower()
    manifest = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [q["id"] for q in manifest["points"]] == [p.id for p in (p0, p1, p2, p3)]

    # Run again: only the failed point would be retried.
    assert sweep_main([path, "--local", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would run: ") == 1 and p3.id in out.split("would run: ")[1]
    assert "1 failed" in out and "3 finished" in out


def test_a_run_that_converged_early_is_finished_for_the_sweep_and_the_report(tmp_path, capsys):
    """--stop-epsilon ends a run before --rounds (Mix2FLD's configs converge after ~5 of 30): it is
    finished, skipped by a re-submitted sweep and averaged into the report. It used to read as
    interrupted (last round < rounds), so the sweep re-ran it and the report left it out."""
    from fedhpc.report.cli import main as report_main
    torch.set_num_threads(1)
    path = write_grid(tmp_path, {"base": {**TINY, "stop_epsilon": 1e9}, "axes": {"seed": [0]}})
    (point,) = expand(load_grid(path))
    run_dir = tmp_path / "sweep" / "runs" / point.id
    f = tmp_path / "p.yaml"
    f.write_text(point_yaml(load_grid(path), point))
    _run_in_process(str(f), str(run_dir))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["round"] == 2 and records[-1]["converged"] is True  # the change needs two rounds
    assert run_state(str(run_dir), 3).status == "finished"
    # the same records without the convergence mark: a run cut short, to be resumed
    cut = tmp_path / "cut"
    cut.mkdir()
    for name in ("config.yaml", "final_model.pt"):
        (cut / name).write_bytes((run_dir / name).read_bytes())
    (cut / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "converged"}) + "\n"
                                               for r in records))
    assert run_state(str(cut), 3).status == "interrupted"
    capsys.readouterr()
    assert sweep_main([path, "--local", "--dry-run"]) == 0
    assert f"{point.id}: finished (round 2/3) -> skip" in capsys.readouterr().out
    assert report_main([str(tmp_path / "sweep" / "runs"), "--out", str(tmp_path / "report")]) == 0
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["excluded"] == [] and len(summary["groups"]) == 1


def test_save_client_models_last_with_stop_epsilon_is_refused_with_the_fix():
    from fedhpc.config import parse_args
    with pytest.raises(ConfigError, match="--save-client-models last cannot be combined with --stop-epsilon.*5,10,15"):
        parse_args(["--stop-epsilon", "0.05", "--save-client-models", "last", "--out", "x"])
    parse_args(["--stop-epsilon", "0.05", "--save-client-models", "5,10", "--out", "x"])  # named rounds are fine


def _fake_run(run_dir, rounds, records):
    """A run folder as the engine leaves it, written by hand: config.yaml, metrics.jsonl, final_model.pt."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"rounds": rounds, "seed": 0}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "final_model.pt").write_bytes(b"")
    return str(run_dir)


@pytest.mark.parametrize("rounds,last,file,words", [
    (3, {"round": "three"}, "metrics.jsonl", "has round 'three', not a whole number"),
    (3, {"round": None}, "metrics.jsonl", "has round None, not a whole number"),
    (3, {"round": 2.5}, "metrics.jsonl", "has round 2.5, not a whole number"),
    ("3 rounds", {"round": 3}, "config.yaml", "says rounds: '3 rounds', not a whole number"),
])
def test_a_damaged_run_is_reported_as_damaged_naming_the_file_and_the_fix(tmp_path, rounds, last, file, words):
    run_dir = _fake_run(tmp_path / "run", rounds, [{"round": 1}, {"round": 2}, last])
    state = run_state(run_dir)
    assert state.status == "damaged", state
    assert words in state.problem and str(tmp_path / "run" / file) in state.problem
    assert f"delete {run_dir} to run it again" in state.problem and state.describe().startswith("damaged (")


def test_damaged_run_without_round_or_with_a_torn_config_is_damaged_too(tmp_path):
    run_dir = _fake_run(tmp_path / "run", 3, [{"round": 1}])
    assert run_state(run_dir, 3, records=[{"round": 1}, {"loss": 0.5}]).problem.endswith(
        f"has round None, not a whole number (the engine writes one per record); repair that line, or delete "
        f"{run_dir} to run it again")
    (tmp_path / "run" / "config.yaml").write_text("rounds: [3\n")
    state = run_state(run_dir)
    assert state.status == "damaged" and "config.yaml cannot be read as YAML" in state.problem


def test_a_sweep_skips_a_damaged_point_and_runs_the_others(tmp_path, capsys):
    path = write_grid(tmp_path, {"base": TINY, "axes": {"seed": [0, 1]}})
    p0, p1 = expand(load_grid(path))
    _fake_run(tmp_path / "sweep" / "runs" / p0.id, 3, [{"round": 1}, {"round": "2"}])
    assert sweep_main([path, "--local", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1 damaged, 1 not started" in out
    assert f"{p0.id}: damaged (the last record of " in out and "-> skip until repaired" in out
    assert out.count("would run: ") == 1 and p1.id in out.split("would run: ")[1]
    # with nothing else to run it does not claim that every point is finished
    for p in (p0, p1):
        _fake_run(tmp_path / "s2" / "runs" / p.id, 3, [{"round": 1}, {"round": "2"}] if p is p0 else [{"round": 3}])
    assert sweep_main([path, "--local", "--dry-run", "--out", str(tmp_path / "s2")]) == 0
    out = capsys.readouterr().out
    assert "nothing to run: 1 point(s) skipped until their folders are repaired" in out
    assert "every point is finished" not in out


def test_the_report_lists_a_damaged_run_with_its_problem_instead_of_crashing(tmp_path, capsys):
    from fedhpc.report.cli import main as report_main
    run_dir = _fake_run(tmp_path / "runs" / "a", 3, [{"round": 1}, {"round": "x"}])
    assert report_main([str(tmp_path / "runs"), "--out", str(tmp_path / "report")]) == 0
    (entry,) = json.loads((tmp_path / "report" / "summary.json").read_text())["excluded"]
    assert entry["path"] == run_dir and entry["status"] == "damaged" and "has round 'x'" in entry["problem"]
    assert "damaged (the last record of" in (tmp_path / "report" / "report.md").read_text()


def _id_hash_before_algorithm_identity(settings):
    """run_hash as it was before it read the algorithm's identity_settings: sweeps on disk hold these ids."""
    import hashlib
    from fedhpc.config import RunConfig
    ident = {k: settings[k] for k in RunConfig.IDENTITY if k in settings}
    blob = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:8]


def test_run_ids_hold_the_settings_of_the_algorithms_checkpoint_identity(tmp_path):
    """pMixFed's schedule reads the total rounds (identity_settings = ("rounds",)), so its checkpoints
    cannot be resumed with another ``rounds``: its id changes with them. Every other algorithm's id
    ignores rounds and is the id earlier versions wrote, so sweeps already on disk keep resuming."""
    from fedhpc.config import RunConfig

    def point(algo, rounds, name):
        base = {"model": "mlp", **({} if rounds is None else {"rounds": rounds})}
        (p,) = expand(load_grid(write_grid(tmp_path, {"base": base, "axes": {"algo": [algo], "seed": [0]}}, name)))
        return p

    pm2, pm3 = point("pmixfed", 2, "a.yaml"), point("pmixfed", 3, "b.yaml")
    assert pm2.label == pm3.label and pm2.id != pm3.id
    # rounds left out is RunConfig's default, as the launcher would run it
    assert point("pmixfed", None, "c.yaml").id == point("pmixfed", RunConfig.rounds, "d.yaml").id
    # the algorithm is looked up by its registered name, whatever the spelling
    assert run_hash({"algo": "PMixFed", "rounds": 2}) != run_hash({"algo": "PMixFed", "rounds": 3})
    for algo in ("fedavg", "fl", "pmixfed_dynamic"):  # no identity_settings: ids as before, whatever the rounds
        ids = {point(algo, r, f"{algo}{r}.yaml").id for r in (2, 50, None)}
        (only,) = ids
        settings = point(algo, 2, "x.yaml").settings
        assert only == f"algo-{algo}_seed-0-{_id_hash_before_algorithm_identity(settings)}"
    # a name no registry knows is refused by validation later; the id itself is still made
    assert run_hash({"algo": 5, "seed": 1}) == _id_hash_before_algorithm_identity({"algo": 5, "seed": 1})
    assert run_hash({"algo": "nope"}) == _id_hash_before_algorithm_identity({"algo": "nope"})


def test_more_rounds_for_a_pmixfed_sweep_start_a_new_run_instead_of_failing_to_resume(tmp_path, capsys):
    """The audit's repro: a pmixfed point ran with rounds 2; with rounds 3 the same id resumed its
    checkpoint, which the engine refuses (rounds: checkpoint 2 vs now 3), and every re-run failed again."""
    from fedhpc.launch import main as launch_main
    torch.set_num_threads(1)
    base = {**TINY, "algo": "pmixfed"}
    path2 = write_grid(tmp_path, {"base": {**base, "rounds": 2}, "axes": {"seed": [0]}}, "r2.yaml")
    (p2,) = expand(load_grid(path2))
    f2 = tmp_path / "p2.yaml"
    f2.write_text(point_yaml(load_grid(path2), p2))
    _run_in_process(str(f2), str(tmp_path / "sweep" / "runs" / p2.id))
    path3 = write_grid(tmp_path, {"base": {**base, "rounds": 3}, "axes": {"seed": [0]}}, "r3.yaml")
    (p3,) = expand(load_grid(path3))
    capsys.readouterr()
    assert sweep_main([path3, "--local", "--dry-run"]) == 0
    assert f"{p3.id}: not started -> run" in capsys.readouterr().out
    f3 = tmp_path / "p3.yaml"
    f3.write_text(point_yaml(load_grid(path3), p3))
    run3 = tmp_path / "sweep" / "runs" / p3.id
    assert launch_main(["--config", str(f3), "--out", str(run3), "--resume"]) == 0
    assert run_state(str(run3), 3).status == "finished"
    assert run_state(str(tmp_path / "sweep" / "runs" / p2.id), 2).status == "finished"  # the old run is left as it was


# --------------------------------------------------------------------------- --data-dir

def test_data_dir_flag_sets_every_point_and_keeps_the_ids(tmp_path, capsys):
    """The mnist grids said "(--data-dir needed)" but the sweep refused --data-dir, and --dry-run
    approved points that each then failed on the nodes ("dataset 'mnist' reads its files from
    --data-dir"). Now the flag sets every point's data_dir, which is no identity setting: same ids."""
    data = tmp_path / "data"
    data.mkdir()
    path = write_grid(tmp_path, {"base": {**TINY, "dataset": "mnist"}, "axes": {"seed": [0, 1]}})
    assert sweep_main([path, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "2 of 2 point(s) fail validation" in err and "points 0-1 (seed-0, ...): dataset 'mnist' reads its files " \
        "from --data-dir, and none is given: pass --data-dir DIR to python -m fedhpc.sweep, or set data_dir: DIR " \
        "in the grid's base" in err
    assert not (tmp_path / "sweep").exists()

    ids = [p.id for p in expand(load_grid(path), validate=False)]
    assert sweep_main([path, "--no-submit", "--data-dir", str(data)]) == 0
    assert "2 not started" in capsys.readouterr().out
    for i in ids:
        written = yaml.safe_load((tmp_path / "sweep" / "points" / f"{i}.yaml").read_text())
        assert written["data_dir"] == str(data) and written["dataset"] == "mnist"
    assert [q["id"] for q in json.loads((tmp_path / "sweep" / "sweep.json").read_text())["points"]] == ids
    assert ids == [p.id for p in expand(load_grid(path), validate=False)]
    # the flag wins over the grid's own data_dir; a relative one is made absolute (the points may run elsewhere)
    grid = load_grid(write_grid(tmp_path, {"base": {**TINY, "dataset": "mnist", "data_dir": "/elsewhere"},
                                           "axes": {"seed": [0, 1]}}, "g2.yaml"))
    grid.data_dir = str(data)
    assert [(p.id, p.settings["data_dir"]) for p in expand(grid)] == [(i, str(data)) for i in ids]


def test_only_points_reading_files_need_a_data_dir(tmp_path):
    """What needs --data-dir is what the readers say (their StoreOptions: a ``dir`` option replaces
    --data-dir), not a list of names: digits and synthetic read no files."""
    path = write_grid(tmp_path, {"base": TINY, "zip": [{
        "dataset": ["digits", "mnist", "synthetic", "fmnist", "mnist", "cifar10"],
        "data_options.dir": [None, None, None, None, str(tmp_path), None]}]})
    with pytest.raises(ConfigError) as e:
        expand(load_grid(path))
    msg = str(e.value)
    assert "3 of 6 point(s) fail validation" in msg
    assert "  point 1 (dataset-mnist): dataset 'mnist' reads its files from --data-dir" in msg
    assert "  point 3 (dataset-fmnist): dataset 'fmnist'" in msg and "  point 5 (dataset-cifar10): dataset 'cifar10'" in msg
    assert "point 0" not in msg and "point 2" not in msg and "point 4" not in msg
    # the sweep's own refusals are said beside the launcher's, all at once
    path = write_grid(tmp_path, {"base": TINY, "zip": [{"dataset": ["mnist", "digits"], "lr": [0.1, -1.0]}]}, "g2.yaml")
    with pytest.raises(ConfigError) as e:
        expand(load_grid(path))
    assert "2 of 2 point(s)" in str(e.value) and "point 0 (dataset-mnist_lr-0.1): dataset 'mnist'" in str(e.value)
    assert "point 1 (dataset-digits_lr--1.0): --lr must be a positive number" in str(e.value)


def test_the_mnist_sweeps_take_data_dir(tmp_path, capsys):
    for name, n in (("mix2fld_fig2_mnist", 48), ("mix2fld_seeds_mnist", 96)):
        grid = f"sweeps/{name}.yaml"
        assert sweep_main([grid, "--dry-run", "--out", str(tmp_path / name)]) == 2
        assert f"points 0-{n - 1} (" in capsys.readouterr().err
        assert sweep_main([grid, "--dry-run", "--out", str(tmp_path / name), "--data-dir", str(tmp_path)]) == 0
        assert f"{n} point(s) ({n} not started)" in capsys.readouterr().out
        assert not (tmp_path / name).exists()


# --------------------------------------------------------------------------- a folder holding another run

def test_a_point_whose_folder_holds_a_run_with_other_settings_is_refused(tmp_path, capsys):
    """The audit's repro: a grid ran with momentum 0.5; the same grid plus nesterov: true has the same
    ids (nesterov is not hashed, so that ids on disk stay valid), and every point was "finished -> skip",
    its config.yaml still saying nesterov: false. Such a point is now refused, before anything runs."""
    torch.set_num_threads(1)
    base = {**TINY, "momentum": 0.5}
    path = write_grid(tmp_path, {"base": base, "axes": {"seed": [0, 1, 2]}})
    grid = load_grid(path)
    p0, p1, p2 = expand(grid)
    runs = tmp_path / "sweep" / "runs"
    f = tmp_path / "p0.yaml"
    f.write_text(point_yaml(grid, p0))
    _run_in_process(str(f), str(runs / p0.id))
    # point 1 was started by hand and stopped early: its folder holds only config.yaml (point 2: nothing)
    (runs / p1.id).mkdir()
    (runs / p1.id / "config.yaml").write_text((runs / p0.id / "config.yaml").read_text().replace("seed: 0", "seed: 1"))
    config0 = (runs / p0.id / "config.yaml").read_text()
    assert sweep_main([path, "--local", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{p0.id}: finished (round 3/3) -> skip" in out and f"{p2.id}: not started -> run" in out

    nesterov = write_grid(tmp_path, {"base": {**base, "nesterov": True}, "axes": {"seed": [0, 1, 2]}}, "n.yaml")
    assert [p.id for p in expand(load_grid(nesterov))] == [p0.id, p1.id, p2.id]  # ids as before
    for argv in ([nesterov, "--local"], [nesterov, "--no-submit"], [nesterov, "--dry-run"]):
        assert sweep_main(argv) == 2
        err = capsys.readouterr().err
        assert "2 point(s) would skip or resume a run made with other settings" in err and "nothing was run" in err
        for p in (p0, p1):
            assert err.count(p.id) == 1
            assert f"point {p.index} ({p.label}), {runs / p.id}: nesterov: the run has False, this point True" in err
        assert "point 2" not in err
        assert "restore the setting(s) in the grid" in err and "--out DIR, or a new name: in the grid" in err
    assert (runs / p0.id / "config.yaml").read_text() == config0
    assert not (tmp_path / "sweep" / "points").exists() and not (tmp_path / "sweep" / "slurm").exists()
    # ... written to another folder it runs
    assert sweep_main([nesterov, "--local", "--dry-run", "--out", str(tmp_path / "other")]) == 0
    assert "3 not started" in capsys.readouterr().out

    # Settings that may change between a run and its resumption still resume it: more rounds,
    # eval cadence, threads, checkpoint cadence, the data folder.
    more = write_grid(tmp_path, {"base": {**base, "rounds": 5, "eval_every": 2, "threads": 2, "checkpoint_every": 2,
                                          "data_dir": str(tmp_path)}, "axes": {"seed": [0, 1, 2]}}, "m.yaml")
    assert [p.id for p in expand(load_grid(more))] == [p0.id, p1.id, p2.id]
    assert sweep_main([more, "--local", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{p0.id}: interrupted (round 3/5) -> resume" in out and out.count("would run: ") == 3


def test_saved_configs_compare_by_meaning_not_by_spelling(tmp_path, capsys):
    """config.yaml is read as a checkpoint's identity is: a field an older version did not write is
    its default (nesterov was added after runs existed), and settings the id holds are not compared
    again (the engine may resolve them: full participation under --cold-start-fraction)."""
    from fedhpc.config import RunConfig
    path = write_grid(tmp_path, {"base": {**TINY, "momentum": 0.5}, "axes": {"seed": [0, 1]}})
    p0, p1 = expand(load_grid(path))
    runs = tmp_path / "sweep" / "runs"
    for p in (p0, p1):
        saved = p.config.to_dict()
        del saved["nesterov"]  # written before the option existed
        if p is p1:
            saved["clients_per_round"] = 3   # resolved by the engine; the id holds the grid's value
            saved["algo"] = "FL"             # an older launcher kept names as typed
        (runs / p.id).mkdir(parents=True)
        (runs / p.id / "config.yaml").write_text(yaml.safe_dump(saved))
    assert sweep_main([path, "--local", "--dry-run"]) == 0
    assert "2 not started" in capsys.readouterr().out  # config.yaml alone: nothing ran yet
    nesterov = write_grid(tmp_path, {"base": {**TINY, "momentum": 0.5, "nesterov": True},
                                     "axes": {"seed": [0, 1]}}, "n.yaml")
    assert sweep_main([nesterov, "--local", "--dry-run"]) == 2
    assert "2 point(s) would skip or resume" in capsys.readouterr().err
    assert RunConfig.nesterov is False
    # a config.yaml that cannot be read: its run cannot be told, so the point waits for a person
    (runs / p1.id / "config.yaml").write_text("algo: [fedavg\n")
    assert sweep_main([path, "--local", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{p1.id}: damaged ({runs / p1.id / 'config.yaml'} cannot be read as YAML" in out
    assert out.count("would run: ") == 1


# --------------------------------------------------------------------------- references

REF_FEDAVG = {"paper": "P", "table": "T1", "row": "FedAvg, digits", "metric": "test_accuracy", "value": 90.0,
              "note": "the file's"}
REF_PROX = {"paper": "P", "table": "T1", "row": "FedProx, digits", "metric": "test_accuracy", "value": 91.0}


def test_a_point_of_another_algorithm_drops_the_reference_of_its_config_file(tmp_path):
    """A launch file's reference is the paper's row for the file's algorithm: a grid whose algo axis
    ran that file as fedprox labelled the fedprox point with FedAvg's row and number."""
    launch = tmp_path / "l.yaml"
    launch.write_text(yaml.safe_dump({**TINY, "algo": "fedavg", "reference": REF_FEDAVG}))
    path = write_grid(tmp_path, {"config": str(launch), "zip": [{"algo": ["fedavg", "fl", "FedAvg", "fedprox"],
                                                                 "seed": [0, 1, 2, 3]}]})
    grid = load_grid(path)
    fedavg, fl, spelled, fedprox = expand(grid)
    for p in (fedavg, fl, spelled):  # an alias or another spelling is the same algorithm: its row stays
        assert p.settings["reference"] == REF_FEDAVG
    assert "reference" not in fedprox.settings and "reference" not in yaml.safe_load(point_yaml(grid, fedprox))
    # the ids are those the points had with the reference (it is no identity setting)
    assert fedprox.id == f"{fedprox.label}-{run_hash({**fedprox.settings, 'reference': REF_FEDAVG})}"

    # a reference set by the point's own zip values is kept, alone (not mixed with the file's row)
    path = write_grid(tmp_path, {"config": str(launch), "zip": [{"algo": ["fedavg", "fedprox", "fedmix"],
                                                                 "reference": [{}, REF_PROX, {"value": 1.0}]}]}, "g2.yaml")
    fedavg, fedprox, fedmix = expand(load_grid(path))
    assert fedavg.settings["reference"] == REF_FEDAVG
    assert fedprox.settings["reference"] == REF_PROX and fedmix.settings["reference"] == {"value": 1.0}

    # the base's reference is the row of the algorithm in effect after the base; each row stays
    # with its own algorithm (the file's "note" does not leak into FedProx's row)
    path = write_grid(tmp_path, {"config": str(launch), "base": {"algo": "fedprox", "reference": REF_PROX},
                                 "axes": {"algo": ["fedprox", "fedavg", "fedmix"]}}, "g3.yaml")
    fedprox, fedavg, fedmix = expand(load_grid(path))
    assert fedprox.settings["reference"] == REF_PROX and fedavg.settings["reference"] == REF_FEDAVG
    assert "reference" not in fedmix.settings
    path = write_grid(tmp_path, {"config": str(launch), "base": {"reference.value": 89.0},
                                 "axes": {"algo": ["fedavg", "fedprox"]}}, "g4.yaml")
    fedavg, fedprox = expand(load_grid(path))
    assert fedavg.settings["reference"] == {**REF_FEDAVG, "value": 89.0} and "reference" not in fedprox.settings
    # per-point launch files: each file's row follows its own algorithm
    launch2 = tmp_path / "l2.yaml"
    launch2.write_text(yaml.safe_dump({**TINY, "algo": "fedprox", "reference": REF_PROX}))
    path = write_grid(tmp_path, {"zip": [{"config": [str(launch), str(launch2), str(launch2)],
                                          "algo": ["fl", "fedprox", "fedmix"]}]}, "g5.yaml")
    fl, fedprox, fedmix = expand(load_grid(path))
    assert fl.settings["reference"] == REF_FEDAVG and fedprox.settings["reference"] == REF_PROX
    assert "reference" not in fedmix.settings


def refs(points):
    return [p.settings.get("reference") for p in points]


def test_a_point_whose_setting_differs_from_the_layer_that_wrote_a_reference_drops_it(tmp_path):
    """A reference is the paper's row for the whole setting of the layer that wrote it, not only its
    algorithm: a partition axis over a non-IID file labelled its IID points with the non-IID row.
    Identity settings are compared by meaning (a partition's spelling, an option at its default);
    the seed and settings outside the identity (rounds) are no other setting."""
    launch = tmp_path / "l.yaml"
    launch.write_text(yaml.safe_dump({**TINY, "algo": "fedavg", "partition": "classes:2", "reference": REF_FEDAVG}))
    path = write_grid(tmp_path, {"config": str(launch),
                                 "axes": {"partition": ["classes:2", "iid", "Classes:02", "dirichlet:0.5"]}})
    grid = load_grid(path)
    points = expand(grid)
    assert refs(points) == [REF_FEDAVG, None, REF_FEDAVG, None]
    assert "reference" not in yaml.safe_load(point_yaml(grid, points[1]))
    # the ids are those the points had with the reference (it is no identity setting)
    assert points[1].id == f"{points[1].label}-{run_hash({**points[1].settings, 'reference': REF_FEDAVG})}"
    # the seed and rounds are no other setting
    path = write_grid(tmp_path, {"config": str(launch), "axes": {"seed": [0, 1], "rounds": [2, 5]}}, "g2.yaml")
    assert refs(expand(load_grid(path))) == [REF_FEDAVG] * 4
    # an option's value: the file's (its default, written out or left out) keeps the row, another drops it
    prox = tmp_path / "prox.yaml"
    prox.write_text(yaml.safe_dump({**TINY, "algo": "fedprox", "algo_options": {"mu": 0.1}, "reference": REF_PROX}))
    path = write_grid(tmp_path, {"config": str(prox), "axes": {"algo_options.mu": [0.1, 0.5, None]}}, "g3.yaml")
    assert refs(expand(load_grid(path))) == [REF_PROX, None, None]  # null: mu left out, its default 0.01
    prox.write_text(yaml.safe_dump({**TINY, "algo": "fedprox", "reference": REF_PROX}))
    assert refs(expand(load_grid(path))) == [None, None, REF_PROX]
    path = write_grid(tmp_path, {"config": str(prox), "axes": {"algo_options.mu": [0.01, 0.5]}}, "g4.yaml")
    assert refs(expand(load_grid(path))) == [REF_PROX, None]


def test_a_reference_is_judged_against_the_settings_of_the_layer_that_wrote_it(tmp_path):
    """The base's reference describes the settings in effect after the base (config file < base),
    the file's the file's own; a reference among the point's own zip values is kept."""
    ref_iid = {"paper": "P", "table": "T1", "row": "FedAvg, IID", "metric": "test_accuracy", "value": 95.0}
    launch = tmp_path / "l.yaml"
    launch.write_text(yaml.safe_dump({**TINY, "algo": "fedavg", "partition": "classes:2", "reference": REF_FEDAVG}))
    path = write_grid(tmp_path, {"config": str(launch), "base": {"partition": "iid", "reference": ref_iid},
                                 "axes": {"partition": ["iid", "classes:2", "dirichlet:0.5"]}})
    assert refs(expand(load_grid(path))) == [ref_iid, REF_FEDAVG, None]  # the file's "note" does not leak
    # a base that changes the file's setting drops the file's row from every point
    path = write_grid(tmp_path, {"config": str(launch), "base": {"partition": "iid"}, "axes": {"seed": [0, 1]}},
                      "g2.yaml")
    assert refs(expand(load_grid(path))) == [None, None]
    # the point's own reference is kept
    path = write_grid(tmp_path, {"config": str(launch), "zip": [{"partition": ["classes:2", "iid", "dirichlet:0.5"],
                                                                 "reference": [{}, ref_iid, {"value": 1.0}]}]},
                      "g3.yaml")
    assert refs(expand(load_grid(path))) == [REF_FEDAVG, ref_iid, {"value": 1.0}]


def test_the_mix2fld_sweeps_label_only_the_points_of_their_rows_setting(monkeypatch):
    """The launch files' rows are Fig. 2's non-IID, asymmetric setting at (N_S, N_I) = (50, 100): the
    IID, symmetric and other (N_S, N_I) points of the repository's sweeps carry no row."""
    from conftest import REPO

    monkeypatch.chdir(REPO)
    points = expand(load_grid("sweeps/mix2fld_fig2_digits.yaml"), validate=False)
    with_row = [p for p in points if p.settings.get("reference")]
    assert sorted({(p.settings["algo"], p.settings["reference"]["row"]) for p in with_row}) == [
        ("fd", "FD, non-IID, asymmetric"), ("fl", "FL (FedAvg), non-IID, asymmetric"),
        ("mix2fld", "Mix2FLD, non-IID, asymmetric, (N_S, N_I) = (50, 100)")]
    assert len(with_row) == 9 and all(p.settings["partition"] == "skewed:2:1:13"
                                      and p.settings["channel"] == "asymmetric" for p in with_row)
    points = expand(load_grid("sweeps/mix2fld_seeds_digits.yaml"), validate=False)
    with_row = [p for p in points if p.settings.get("reference")]
    assert [p.axes["seed"] for p in with_row] == [0, 1, 2]
    assert all(p.axes == {"algo_options.seeds_per_device": 50, "algo_options.inverse_per_device": 100,
                          "algo": "mix2fld", "partition": "skewed:2:1:13", "channel": "asymmetric",
                          "seed": p.axes["seed"]} for p in with_row)


def test_a_rounds_axis_drops_the_reference_of_a_pmixfed_file_only(tmp_path):
    """A sweep axis over rounds changes pMixFed's schedule (its identity_settings), so those points are
    not the file's row; FedAvg's points over rounds keep theirs, as the launcher judges them."""
    launch = tmp_path / "l.yaml"
    ref = {"paper": "P", "row": "pMixFed row", "value": 1.0}
    for algo in ("pmixfed", "fedavg"):
        launch.write_text(yaml.safe_dump({**TINY, "algo": algo, "rounds": 5, "reference": ref}))
        path = write_grid(tmp_path, {"config": str(launch), "axes": {"rounds": [5, 2, 3]}}, f"{algo}.yaml")
        points = expand(load_grid(path))
        assert [bool(p.settings.get("reference")) for p in points] == ([True, False, False] if algo == "pmixfed"
                                                                        else [True, True, True]), algo


def test_a_finished_run_dealt_under_older_partition_rules_is_refused(tmp_path, capsys, monkeypatch):
    """The same partition spec may mean another split under older rules (PARTITION_RULES 1: classes:K
    was a cyclic deal), which a checkpoint's identity holds but config.yaml does not: a finished run
    made so was skipped by a re-submitted sweep as this point's. The engine now records its identity
    (identity.json) and the sweep refuses the point, naming the fix; a run written before that file
    is judged by its last checkpoint, and one with neither is taken as today's, as before."""
    import shutil

    import fedhpc.data.partition as partition
    torch.set_num_threads(1)
    path = write_grid(tmp_path, {"base": {**TINY, "partition": "classes:2"}, "axes": {"seed": [0, 1]}})
    grid = load_grid(path)
    runs = tmp_path / "sweep" / "runs"
    for p in expand(grid):
        f = tmp_path / f"{p.id}.yaml"
        f.write_text(point_yaml(grid, p))
        with monkeypatch.context() as m:
            if p.index == 0:  # point 0 ran under the rules before today's
                m.setattr(partition, "PARTITION_RULES", partition.PARTITION_RULES - 1)
            _run_in_process(str(f), str(runs / p.id))
    p0, p1 = expand(grid)
    old = partition.PARTITION_RULES - 1
    assert json.loads((runs / p0.id / "identity.json").read_text())["partition_rules"] == old
    assert run_state(str(runs / p0.id), 3).status == "finished"
    capsys.readouterr()

    def refused():
        assert sweep_main([path, "--local", "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert "1 point(s) would skip or resume a run made with other settings" in err
        assert (f"  point 0 (seed-0), {runs / p0.id}: partition_rules: the run's partition 'classes:2' was dealt "
                f"under partition rules {old}, this point's under rules {partition.PARTITION_RULES}, which may deal "
                f"another split") in err
        assert "delete the folder of a run dealt under other partition rules to run its point again" in err
        assert "--out DIR" in err and "restore the setting" not in err and p1.id not in err

    refused()
    # written before runs recorded identity.json: its last checkpoint says the rules
    (runs / p0.id / "identity.json").unlink()
    refused()
    # neither: taken as made under today's rules, as the sweep always took it
    shutil.rmtree(runs / p0.id / "checkpoints")
    assert sweep_main([path, "--local", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{p0.id}: finished (round 3/3) -> skip" in out and f"{p1.id}: finished (round 3/3) -> skip" in out
    # a hand-broken record: the run cannot be told, a person must look
    (runs / p1.id / "identity.json").write_text("{")
    assert sweep_main([path, "--local", "--dry-run"]) == 0
    assert f"{p1.id}: damaged ({runs / p1.id / 'identity.json'} cannot be read" in capsys.readouterr().out


def test_a_finished_point_names_its_headline_accuracy(tmp_path, capsys):
    """The line after a point ran names the global model's test accuracy; FD has none and names its
    devices' mean accuracy on their splits instead (it named nothing); a partial personal method
    (FedPer), whose global model has initial personal layers, names both."""
    path = write_grid(tmp_path, {"base": {**TINY, "rounds": 1}, "axes": {"algo": ["fedavg", "fd", "fedper"]}})
    assert sweep_main([path, "--local"]) == 0
    done = [line.strip() for line in capsys.readouterr().out.splitlines() if "done:" in line]
    runs = tmp_path / "sweep" / "runs"
    last = {p.name.split("-")[1].split("_")[0]: json.loads((p / "metrics.jsonl").read_text().splitlines()[-1])
            for p in runs.iterdir()}
    assert [d.split(",")[0] for d in done] == [f"done: test_accuracy {last['fedavg']['test_accuracy']:.4f}",
                                              f"done: local_test_accuracy_mean "
                                              f"{last['fd']['local_test_accuracy_mean']:.4f}",
                                              f"done: test_accuracy {last['fedper']['test_accuracy']:.4f}"]
    assert f"local_test_accuracy_mean {last['fedper']['local_test_accuracy_mean']:.4f}, " in done[2]
