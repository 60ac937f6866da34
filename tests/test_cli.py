"""Configuration from flags and YAML, --help, and every bad input named in the foundation issue."""

import os

import pytest
import yaml

from fedhpc.config import parse_args
from fedhpc.errors import ConfigError
from fedhpc.launch import main


def run_main(argv, capsys):
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_yaml_then_flags_override(tmp_path):
    cfgfile = tmp_path / "x.yaml"
    cfgfile.write_text(yaml.safe_dump({"algo": "fedprox", "rounds": 7, "lr": 0.2,
                                       "algo_options": {"mu": 0.3}, "data_options": {"test_fraction": 0.3}}))
    cfg, algo_opts, data_opts = parse_args(["--config", str(cfgfile), "--lr", "0.05", "--mu", "0.4"])
    assert (cfg.algo, cfg.rounds, cfg.lr) == ("fedprox", 7, 0.05)
    assert algo_opts.mu == 0.4 and data_opts.test_fraction == 0.3
    cfg, algo_opts, _ = parse_args(["--config", str(cfgfile)])
    assert algo_opts.mu == 0.3 and cfg.lr == 0.2


LAUNCH_DIR = os.path.join(os.path.dirname(__file__), "..", "launch")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(LAUNCH_DIR) if f.endswith(".yaml")))
def test_shipped_yaml_files_are_valid_configs(name):
    """Every experiment file names registered algorithms/datasets and valid, typed options."""
    cfg, _, _ = parse_args(["--config", os.path.join(LAUNCH_DIR, name)])
    from fedhpc.models import MODELS, load_model_modules
    load_model_modules()
    assert cfg.model == "auto" or cfg.model in MODELS, cfg.model


def test_help_lists_algorithms_and_datasets(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("fedavg", "fedprox", "digits", "dirichlet:ALPHA", "classes:K", "--clients-per-round"):
        assert name in out


def test_help_stars_the_methods_that_train_clients_at_once(capsys):
    """The list of algorithms marks those --clients-at-once > 1 accepts (from the registry, not a list
    kept by hand): the main job and the families opted in, not the methods that refuse it."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    listing = out[out.index("\nalgorithms"):out.index("\ndatasets:")].splitlines()[2:]
    starred = {line.split()[0].lstrip("*") for line in listing if line.startswith(" *")}
    plain = {line.split()[0] for line in listing if line.startswith("  ") and "=" not in line.split()[1]}
    assert {"fedavg", "fedmix", "mix2fld", "fd", "ditto", "pmixfed", "moon", "fedalign", "globalmix", "stochdepth",
            "per_fedavg", "gradaug"} <= starred
    assert {"xormixfl", "mixfl", "standalone"} <= plain
    from fedhpc.algorithms import ALGORITHMS
    assert starred | plain == set(ALGORITHMS.names()) and not starred & plain
    code, _, err = run_main(["--algo", "xormixfl", "--clients-at-once", "2", "--rounds", "1", "--no-out"], capsys)
    assert code == 2 and "does not support --clients-at-once > 1" in err

def test_algorithm_options_appear_once_algo_is_given(capsys):
    with pytest.raises(SystemExit):
        main(["--algo", "fedprox", "--help"])
    assert "--mu" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle,fix", [
    (["--algo", "fedmagic"], "unknown algorithm 'fedmagic'", "fedavg"),
    (["--dataset", "mnist-ish"], "unknown dataset 'mnist-ish'", "digits"),
    (["--clients-per-round", "30", "--num-clients", "20"], "--clients-per-round", "between 1 and"),
    (["--clients-per-round", "0"], "--clients-per-round", "between 1 and"),
    (["--rounds", "0"], "--rounds must be positive", "got 0"),
    (["--rounds", "-3"], "--rounds must be positive", "got -3"),
    (["--lr", "0"], "--lr must be a positive number", "got 0"),
    (["--lr", "-0.1"], "--lr must be a positive number", "got -0.1"),
    (["--lr", "nan"], "--lr must be a positive number", "nan"),
    (["--partition", "dirichlet:zero"], "dirichlet", "e.g. dirichlet:0.5"),
    (["--partition", "halves"], "unknown partition", "iid"),
    (["--num-clients", "2000", "--clients-per-round", "5"], "clients", "--num-clients"),
    (["--partition", "dirichlet:0.001", "--num-clients", "200", "--clients-per-round", "5"], "partition", "milder"),
    (["--model", "transformer9000"], "unknown model", "mlp"),
    (["--algo", "fedprox", "--mu", "-1"], "--mu must be non-negative", "-1"),
    (["--resume"], "--resume needs --out", "--out"),
    (["--model-opt", "depthh=3"], "has no option(s) ['depthh']", "hidden"),
    # argparse knows only the chosen algorithm's options: another one's is named with its methods
    (["--algo", "fedmix", "--server-steps", "20"], "--server-steps is an option of algorithm(s) fld, mix2fld",
     "choose one of them with --algo, or drop --server-steps"),
    (["--mu=0.1"], "--mu is an option of algorithm(s) fedalign, fedprox", "not of fedavg"),
    (["--lcoal-epochs", "3"], "--lcoal-epochs is no flag", "did you mean --local-epochs?"),
])
def test_bad_input_names_problem_and_fix_and_writes_nothing(tmp_path, capsys, argv, needle, fix):
    out = tmp_path / "out"
    args = argv + (["--out", str(out)] if "--resume" not in argv else []) + ["--quiet", "--no-tensorboard"]
    code, _, err = run_main(args, capsys)
    assert code == 2, err
    assert err.startswith("error: ") and needle in err and fix in err, err
    assert "Traceback" not in err
    assert not out.exists(), "no output may be written for a refused configuration"


def test_missing_and_malformed_config_files(tmp_path, capsys):
    code, _, err = run_main(["--config", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2 and "does not exist" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    code, _, err = run_main(["--config", str(bad)], capsys)
    assert code == 2 and "not valid YAML" in err
    typo = tmp_path / "typo.yaml"
    typo.write_text("roundz: 3\n")
    code, _, err = run_main(["--config", str(typo)], capsys)
    assert code == 2 and "unknown setting(s) ['roundz']" in err
    wrongtype = tmp_path / "type.yaml"
    wrongtype.write_text("rounds: many\n")
    code, _, err = run_main(["--config", str(wrongtype)], capsys)
    assert code == 2 and "--rounds must be of type int" in err


def test_nan_loss_stops_and_keeps_earlier_output(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_main(["--lr", "1e30", "--rounds", "3", "--num-clients", "4", "--clients-per-round", "2",
                             "--out", str(out), "--quiet", "--no-tensorboard", "--model", "mlp"], capsys)
    assert code == 3
    assert "NaN or infinite" in err and "lower --lr" in err
    assert not (out / "final_model.pt").exists()


def test_config_error_type_is_user_facing():
    with pytest.raises(ConfigError):
        parse_args(["--batch-size", "0"])


def test_fl_is_fedavg_under_its_mix2fld_name(tmp_path):
    """`--algo fl` (the Mix2FLD paper's name) runs FedAvg itself: same final model."""
    from conftest import FAST, final_weights, launch, max_diff
    outs = []
    for algo in ("fl", "fedavg"):
        out = str(tmp_path / algo)
        p = launch(FAST + ["--algo", algo, "--rounds", "2", "--out", out])
        assert p.returncode == 0, p.stderr
        outs.append(final_weights(out))
    assert max_diff(*outs) == 0.0
