"""Bad configuration input is refused with a ConfigError naming the problem and the fix, before
anything is written or any dataset is loaded: YAML files and grids (encoding, duplicate keys,
names that are not strings, stray option keys), KEY=VALUE options, model options, partition
specs, and names stored as the registry spells them."""

import os
import warnings

import pytest
import yaml

from conftest import REPO
from fedhpc.config import parse_args
from fedhpc.errors import ConfigError
from fedhpc.launch import main
from fedhpc.sweep import expand, load_grid
from fedhpc.sweep.cli import main as sweep_main

TINY = ["--rounds", "1", "--num-clients", "4", "--clients-per-round", "2", "--model", "mlp",
        "--quiet", "--threads", "1", "--no-tensorboard"]
GRID_BASE = {"num_clients": 8, "clients_per_round": 4, "model": "mlp", "quiet": True, "rounds": 1,
             "tensorboard": False}


def refused(argv, capsys, tmp_path):
    """Run the launcher; assert exit code 2, a one-line error, no traceback, no output folder."""
    out = tmp_path / "out"
    code = main(argv + ["--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert not out.exists(), "no output may be written for a refused configuration"
    return err


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


# --------------------------------------------------------------------------- 1. encoding

def test_non_utf8_config_and_grid_files_are_refused_with_the_fix(tmp_path, capsys):
    cfg = write(tmp_path, "utf16.yaml", b"\xff\xfealgo: fedavg\n")
    err = refused(["--config", cfg] + TINY, capsys, tmp_path)
    assert "not UTF-8" in err and "save it as UTF-8" in err and "0xff" in err
    grid = write(tmp_path, "grid.yaml", b"\xff\xfebase: {rounds: 1}\nout: " + str(tmp_path / "sweep").encode())
    assert sweep_main([grid, "--local", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "grid file" in err and "not UTF-8" in err and "save it as UTF-8" in err and "Traceback" not in err
    # a grid's launch file is read the same way
    grid = write(tmp_path, "grid2.yaml", yaml.safe_dump({"config": cfg, "base": GRID_BASE}))
    with pytest.raises(ConfigError, match="not UTF-8"):
        expand(load_grid(grid))


# --------------------------------------------------------------------------- 2. names of the wrong type

@pytest.mark.parametrize("key", ["algo", "dataset", "model"])
@pytest.mark.parametrize("value", ["null", "5", "[fedavg]", "true"])
def test_a_name_that_is_not_a_string_is_refused_naming_the_setting(tmp_path, capsys, key, value):
    cfg = write(tmp_path, "c.yaml", f"{key}: {value}\n")
    err = refused(["--config", cfg, "--rounds", "1"], capsys, tmp_path)
    assert f"{key} must be a name (a string)" in err and f"`{key}: " in err


def test_registry_lookup_of_a_non_string_is_a_config_error():
    from fedhpc.algorithms import ALGORITHMS, load_algorithm_modules
    load_algorithm_modules()
    with pytest.raises(ConfigError, match="named by a string.*fedavg"):
        ALGORITHMS.get(None)
    assert 5 not in ALGORITHMS


# --------------------------------------------------------------------------- 3. KEY=VALUE that is not YAML

@pytest.mark.parametrize("flag,item", [("--data-opt", "test_fraction=["), ("--model-opt", "hidden={a"),
                                       ("--channel-opt", "p_up_dbm=]")])
def test_option_value_that_is_not_yaml_is_refused(tmp_path, capsys, flag, item):
    err = refused(TINY + [flag, item], capsys, tmp_path)
    assert flag in err and "is not valid YAML" in err and "in quotes" in err


# --------------------------------------------------------------------------- 4. model option types and ranges

@pytest.mark.parametrize("model,opt,words", [
    ("cnn", "width=-3", "'width' is a size and must be a positive integer, got -3"),
    ("cnn", "width=0", "must be a positive integer, got 0"),
    ("cnn", "width=abc", "'width' must be an integer, got 'abc'"),
    ("cnn", "width=8.5", "'width' must be an integer"),
    ("cnn", "dropout=.nan", "'dropout' must be a finite non-negative number"),
    ("cnn", "norm=5", "'norm' must be a string"),
    ("mlp", "depth=true", "'depth' must be an integer, got True"),
    ("mix2fld_cnn", "channels=[4]", "'channels' must be a list of 2 values"),
    ("mix2fld_cnn", "channels=[4, -1]", "'channels' holds a value that is a size"),
    ("mix2fld_cnn", "bias=1", "'bias' must be true or false"),
    ("lenet5", "conv1_padding=-1", "'conv1_padding' must be >= 0"),
])
def test_model_option_of_wrong_type_or_range_is_refused_before_the_data(tmp_path, capsys, monkeypatch,
                                                                        model, opt, words):
    def no_data(*a, **k):
        raise AssertionError("the dataset was loaded before the model options were checked")

    monkeypatch.setattr("fedhpc.engine.build_dataset", no_data)  # where the launcher's engine loads data
    argv = [a for a in TINY if a != "mlp" and a != "--model"] + ["--model", model, "--model-opt", opt]
    err = refused(argv, capsys, tmp_path)
    assert words in err and "e.g. --model-opt" in err and "(the default)" in err


def test_model_options_that_are_valid_pass_the_check():
    from fedhpc.models import check_model_options
    check_model_options("lenet5", {"conv1_padding": 0})            # 0 pads nothing
    check_model_options("resnet56", {"projection_dim": 0})          # 0 = off, its default
    check_model_options("mix2fld_cnn", {"channels": [4, 8], "padding": (0, 1), "bias": True})
    check_model_options("mobilenet", {"width_multiplier": 1})       # an integer is a number
    check_model_options("cnn", {"norm": "batch", "dropout": 0.25, "width": 4})


def test_misspelled_model_option_suggests_the_near_name():
    with pytest.raises(ConfigError, match=r"no option\(s\) \['widht'\] \(did you mean 'width'\?\)"):
        parse_args(["--model", "cnn", "--model-opt", "widht=4"])


# --------------------------------------------------------------------------- 5. duplicate keys

@pytest.mark.parametrize("text,key,lines", [
    ("rounds: 1\nlr: 0.1\nrounds: 2\n", "rounds", "lines 1 and 3"),
    ("algo: fedprox\nalgo_options:\n  mu: 0.1\n  mu: 0.2\n", "mu", "lines 3 and 4"),
    ("data_options: {test_fraction: 0.1, test_fraction: 0.2}\n", "test_fraction", "lines 1 and 1"),
    ("model: mlp\nmodel_options:\n  hidden: 8\n  depth: 2\n  hidden: 16\n", "hidden", "lines 3 and 5"),
])
def test_duplicate_keys_are_refused_naming_key_and_lines(tmp_path, capsys, text, key, lines):
    err = refused(["--config", write(tmp_path, "d.yaml", text), "--rounds", "1"], capsys, tmp_path)
    assert f"sets {key!r} twice ({lines})" in err and "delete the one" in err


def test_duplicate_keys_in_a_grid_or_its_launch_file_are_refused(tmp_path, capsys):
    out = str(tmp_path / "sweep")
    grid = write(tmp_path, "g.yaml", f"base: {{rounds: 1}}\naxes:\n  seed: [0, 1]\n  seed: [2]\nout: {out}\n")
    assert sweep_main([grid, "--local", "--dry-run"]) == 2
    assert "sets 'seed' twice (lines 3 and 4)" in capsys.readouterr().err
    launch = write(tmp_path, "l.yaml", "lr: 0.1\nlr: 0.2\n")
    grid = write(tmp_path, "g2.yaml", yaml.safe_dump({"config": launch, "base": GRID_BASE, "out": out}))
    assert sweep_main([grid, "--local", "--dry-run"]) == 2
    assert "sets 'lr' twice (lines 1 and 2)" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


def test_a_key_set_twice_is_refused_but_a_merge_key_may_still_be_overridden(tmp_path):
    with pytest.raises(ConfigError, match="sets 'mu' twice"):
        parse_args(["--config", write(tmp_path, "d.yaml", "algo: fedprox\nalgo_options: {mu: 0.1, mu: 0.3}\n")])
    # `<<:` merges a mapping whose keys the enclosing one may override: that is not a duplicate
    cfg = write(tmp_path, "m.yaml", "algo: fedprox\nalgo_options:\n  <<: {mu: 0.1}\n  mu: 0.3\n")
    assert parse_args(["--config", cfg])[1].mu == 0.3


# --------------------------------------------------------------------------- 6. canonical names

@pytest.mark.parametrize("argv,field,stored", [
    (["--algo", "Fedprox"], "algo", "fedprox"),
    (["--algo", "fl"], "algo", "fedavg"),          # the alias: the run is FedAvg, and its identity says so
    (["--algo", "FL"], "algo", "fedavg"),
    (["--dataset", "Digits"], "dataset", "digits"),
    (["--model", "MLP"], "model", "mlp"),
    (["--model", "Auto"], "model", "auto"),
])
def test_names_are_stored_as_the_registry_spells_them(argv, field, stored):
    cfg = parse_args(argv)[0]
    assert getattr(cfg, field) == stored and cfg.identity()[field] == stored


def test_yaml_names_are_canonical_too_and_a_run_resumes_under_any_spelling(tmp_path, capsys):
    cfg = write(tmp_path, "c.yaml", "algo: Fedprox\nalgo_options: {mu: 0.01}\n")
    out = str(tmp_path / "run")
    base = ["--num-clients", "4", "--clients-per-round", "2", "--model", "mlp", "--quiet", "--threads", "1",
            "--no-tensorboard", "--out", out]
    assert main(["--config", cfg, "--rounds", "1"] + base) == 0
    assert yaml.safe_load(open(f"{out}/config.yaml"))["algo"] == "fedprox"
    code = main(["--algo", "fedprox", "--mu", "0.01", "--rounds", "2", "--resume"] + base)
    assert code == 0, capsys.readouterr().err


def test_sweep_points_that_differ_only_by_spelling_are_one_run(tmp_path):
    grid = write(tmp_path, "g.yaml", yaml.safe_dump({"base": GRID_BASE, "axes": {"algo": ["fl", "fedavg", "Fedprox"]},
                                                     "out": str(tmp_path / "sweep")}))
    with pytest.raises(ConfigError) as e:
        expand(load_grid(grid))
    assert "point 1 (algo-fedavg): the same run as point 0" in str(e.value) and "remove one" in str(e.value)
    assert "point 2" not in str(e.value)


# --------------------------------------------------------------------------- 7. non-finite Dirichlet alpha

@pytest.mark.parametrize("spec", ["dirichlet:inf", "dirichlet:Infinity"])
def test_non_finite_dirichlet_alpha_is_refused_up_front(tmp_path, capsys, spec):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy RuntimeWarning on the way
        err = refused(TINY + ["--partition", spec], capsys, tmp_path)
    assert spec in err and "larger Dirichlet alpha" not in err
    assert "dirichlet:0.5" in err or "dirichlet:100" in err


# --------------------------------------------------------------------------- 8. stray top-level keys

@pytest.mark.parametrize("text,words", [
    ("algo: fedprox\nmu: 0.1\n",
     "'mu' is an option of algorithm 'fedprox': put it under algo_options (`algo_options: {mu: 0.1}`)"),
    ("test_fraction: 0.3\n", "'test_fraction' is an option of dataset 'digits': put it under data_options"),
    ("model: mlp\nhidden: 8\n", "'hidden' is an option of model 'mlp': put it under model_options"),
    ("mu: 0.1\n", "'mu' is an option of algorithm(s) fedalign, fedprox"),
    ("roundz: 3\n", "'roundz' is not a setting (did you mean 'rounds'?)"),
])
def test_a_stray_top_level_key_says_where_it_belongs(tmp_path, capsys, text, words):
    err = refused(["--config", write(tmp_path, "s.yaml", text)], capsys, tmp_path)
    assert "unknown setting(s)" in err and words in err, err
    assert "valid: [" not in err  # every key above got a specific hint; the full list only helps when none does


# --------------------------------------------------------------------------- 9. input too small

def test_input_too_small_for_the_model_names_the_fix():
    from fedhpc.models import build_model
    with pytest.raises(ConfigError) as e:
        build_model("lenet5", (1, 5, 5), 10)
    assert "too small" in str(e.value) and "--model mlp" in str(e.value) and "larger inputs" in str(e.value)


# --------------------------------------------------------------------------- 10. checks without data

@pytest.mark.parametrize("spec,words", [
    ("dirichlet:-1", "positive alpha"), ("dirichlet:x", "positive number"), ("dirichlet:nan", "positive alpha"),
    ("dirichlet:inf", "finite alpha"), ("classes:0", "K >= 1"),
    ("classes_cyclic:two", "needs an integer"), ("skewed:2:2", "M:A:B"), ("iid:3", "takes no argument"),
    ("mix2fld:1", "takes no argument"), ("deficient:0,2:-1:60", "non-negative"), ("halves", "unknown partition"),
])
def test_partition_spec_is_checked_without_data(spec, words):
    from fedhpc.data.partition import check_partition
    with pytest.raises(ConfigError, match=words):
        check_partition(spec)
    with pytest.raises(ConfigError, match=words):
        parse_args(["--partition", spec])


def test_valid_partition_specs_pass_the_check():
    from fedhpc.data.partition import check_partition
    for spec in ["auto", "iid", "dirichlet:0.5", "classes:2", "classes_cyclic:3", "skewed:2:2:62", "mix2fld",
                 "deficient:0,2:2:60", "natural"]:
        check_partition(spec)


def test_sweep_dry_run_refuses_a_bad_partition_or_model_option_before_anything_runs(tmp_path, capsys):
    grid = write(tmp_path, "g.yaml", yaml.safe_dump({
        "base": {**GRID_BASE, "model": "cnn"},
        "zip": [{"partition": ["dirichlet:0.5", "dirichlet:-1", "iid"],
                 "model_options.widht": [None, None, 4]}],
        "out": str(tmp_path / "sweep")}))
    assert sweep_main([grid, "--local", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "2 of 3 point(s) fail validation" in err
    assert "point 1 (partition-dirichlet--1): partition 'dirichlet:-1' needs a positive alpha" in err
    assert "point 2 (widht-4_partition-iid): model 'cnn' has no option(s) ['widht'] (did you mean 'width'?)" in err
    assert not (tmp_path / "sweep").exists()


# --------------------------------------------------------------------------- 11. rounds that are never reached

def test_save_client_models_past_rounds_is_refused_naming_round_rounds_and_fix(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"names round\(s\) 30 but --rounds is 20.*use rounds <= 20 or 'last'"):
        parse_args(["--rounds", "20", "--save-client-models", "5,30,last", "--out", "x"])
    err = refused(TINY + ["--save-client-models", "2"], capsys, tmp_path)  # TINY has --rounds 1
    assert "round(s) 2 but --rounds is 1" in err and "use rounds <= 1 or 'last'" in err
    # the check is against this invocation's --rounds: a run extended to more rounds may name later ones
    assert parse_args(["--rounds", "30", "--save-client-models", "5,30,last", "--out", "x"])[0].rounds == 30


# --------------------------------------------------------------------------- 12. a batch BatchNorm cannot train on

SINGLE = ["--rounds", "1", "--num-clients", "4", "--clients-per-round", "2", "--partition", "iid",
          "--quiet", "--threads", "1", "--no-tensorboard"]  # 288 training samples per client


@pytest.mark.parametrize("argv", [
    ["--model", "mobilenet"],                                           # 1x1 before its last BatchNorm on 8x8
    ["--algo", "gradaug", "--model", "resnet_digits", "--scales", "0.5"],  # only its 4x4 sub-network does
])
def test_a_single_sample_batch_batchnorm_cannot_train_on_is_refused_before_any_round(argv, capsys, tmp_path):
    err = refused(SINGLE + argv + ["--batch-size", "287"], capsys, tmp_path)
    assert "client 0 has 288 training samples, so its last batch of --batch-size 287 holds one sample" in err
    assert "(4 client(s) have such a batch)" in err and "e.g. --batch-size 288" in err
    # without the check the run would start, and stop in the round that samples such a client
    from fedhpc.engine import Engine
    from fedhpc.world import World
    cfg, ao, do = parse_args(SINGLE + argv + ["--batch-size", "287"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("fedhpc.engine.check_single_sample_batches", lambda *a, **k: None)
        eng = Engine(cfg, ao, do, World(threads=1))
        with pytest.raises(Exception, match="Expected more than 1 value per channel"):
            eng.run_round(0)
    # a batch size that leaves no client a lone sample, or a model that never reaches 1x1, is fine
    assert main(SINGLE + argv + ["--batch-size", "288", "--no-out"]) == 0
    assert main(SINGLE + ["--model", "cnn", "--model-opt", "norm=batch", "--batch-size", "287", "--no-out"]) == 0


def test_batch_size_one_whose_every_batch_batchnorm_cannot_train_on_is_refused(capsys, tmp_path):
    """At --batch-size 1 every batch holds one sample, whatever a client's size (n % 1 is 0, which
    the last-batch rule alone missed: the run stopped in round 1 with torch's ValueError)."""
    err = refused(SINGLE + ["--model", "mobilenet", "--batch-size", "1"], capsys, tmp_path)
    assert "client 0 has 288 training samples, so every batch of --batch-size 1 holds one sample" in err
    assert "(4 client(s) have such a batch)" in err and "e.g. --batch-size 2" in err
    # a model whose BatchNorm never sees a 1x1 map trains at batch size 1
    assert main(SINGLE + ["--model", "cnn", "--model-opt", "norm=batch", "--batch-size", "1", "--no-out"]) == 0


def test_an_empty_yaml_value_is_refused_not_read_as_the_text_none(tmp_path):
    """`out:` with nothing after it is YAML null; str(None) made a folder named 'None'."""
    path = tmp_path / "run.yaml"
    path.write_text("rounds: 2\nout:\n")
    with pytest.raises(ConfigError, match=r"--out has no value .*remove the line to use the default"):
        parse_args(["--config", str(path)])
    path.write_text("rounds: 2\nalgo: fedprox\nalgo_options:\n  mu:\n")
    with pytest.raises(ConfigError, match="mu"):
        parse_args(["--config", str(path)])


FEDPROX_FILE = os.path.join(REPO, "launch", "digits_fedprox.yaml")
PMIXFED_FILE = os.path.join(REPO, "launch", "pmixfed_digits.yaml")


def test_algo_flag_replacing_the_files_algorithm_carries_only_the_options_it_has(capsys):
    """A file's algo_options belong to its algo: under another --algo, the options that
    algorithm also has carry over (said, since a name can mean another thing) and the others
    are dropped (said) instead of refusing a run no flag could fix."""
    cfg, ao, _ = parse_args(["--config", FEDPROX_FILE, "--algo", "fedavg"])
    assert cfg.algo == "fedavg" and cfg.algo_options == {}
    assert "--algo fedavg replaces the file's algo fedprox; of its algo_options, mu dropped" in capsys.readouterr().err
    # FedProx's mu (a proximal weight) is not pMixFed-Dynamic's (a mix factor): named, not carried over
    cfg, ao, _ = parse_args(["--config", FEDPROX_FILE, "--algo", "pmixfed_dynamic"])
    assert ao.mu == 0.5
    assert "mu=0.01 not carried over (pmixfed_dynamic's option of that name means another thing; its " \
        "default applies; --mu sets it)" in capsys.readouterr().err
    cfg, ao, _ = parse_args(["--config", FEDPROX_FILE, "--algo", "pmixfed_dynamic", "--mu", "0.5"])
    assert ao.mu == 0.5
    cfg, ao, _ = parse_args(["--config", PMIXFED_FILE, "--algo", "fedavg"])
    assert ao.finetune_epochs == 4  # the pMixFed table's protocol serves every method
    # the file's own algorithm, however spelled: nothing to say
    capsys.readouterr()
    cfg, ao, _ = parse_args(["--config", FEDPROX_FILE, "--algo", "FedProx"])
    assert ao.mu == 0.01 and capsys.readouterr().err == ""


PMIXFED_TABLE_FILE = os.path.join(REPO, "launch", "pmixfed_cifar10_cnn_n10_c100.yaml")
MIX2FLD_FILE = os.path.join(REPO, "launch", "mix2fld_digits.yaml")
MIX2FLD_FL_FILE = os.path.join(REPO, "launch", "mix2fld_digits_fl.yaml")


def test_algo_flag_replacing_the_files_algorithm_drops_its_reference(tmp_path, capsys):
    """A file's reference is its own algorithm's paper number: under another --algo the report
    would show that run against it, labelled as the file's row. It is dropped, and said."""
    cfg, _, _ = parse_args(["--config", PMIXFED_TABLE_FILE])
    assert cfg.reference["row"] == "pMixFed, CIFAR-10, CNN, N=10, C=100%"
    cfg, _, _ = parse_args(["--config", PMIXFED_TABLE_FILE, "--algo", "fedavg"])
    assert cfg.algo == "fedavg" and cfg.reference == {}
    err = capsys.readouterr().err
    assert "--algo fedavg replaces the file's algo pmixfed" in err
    assert "its reference (pMixFed, CIFAR-10, CNN, N=10, C=100%) is pmixfed's and is dropped" in err
    # a file without algo_options says so too
    path = write(tmp_path, "ref.yaml", "algo: fedprox\nreference: {paper: P, row: FedProx row, value: 1.0}\n")
    cfg, _, _ = parse_args(["--config", path, "--algo", "fedavg"])
    assert cfg.reference == {}
    assert "its reference (FedProx row) is fedprox's and is dropped" in capsys.readouterr().err
    # the file's own algorithm under another spelling or an alias is no replacement: kept, nothing said
    for argv in (["--config", PMIXFED_TABLE_FILE, "--algo", "PMixFed"],
                 ["--config", MIX2FLD_FL_FILE, "--algo", "fedavg"],
                 ["--config", MIX2FLD_FL_FILE, "--algo", "FedAvg"],
                 ["--config", path, "--algo", "fedprox"]):
        cfg, _, _ = parse_args(argv)
        assert cfg.reference and capsys.readouterr().err == "", argv


MIX2FLD_ROW = "Mix2FLD, non-IID, asymmetric, (N_S, N_I) = (50, 100)"


def test_flags_that_change_the_files_setting_drop_its_reference(tmp_path, capsys):
    """A file's reference is the paper's number for the file's whole setting: --partition iid over
    the non-IID Mix2FLD file held the IID run against the non-IID row. A flag changing an identity
    setting (partition, channel, an option...) drops it and the note names the settings; --seed and
    settings outside the identity (--rounds, --eval-every, --threads) keep it, as does restating the
    file's own values in another spelling."""
    capsys.readouterr()
    cfg, _, _ = parse_args(["--config", MIX2FLD_FILE, "--partition", "iid"])
    assert cfg.partition == "iid" and cfg.reference == {}
    err = capsys.readouterr().err
    assert f"its reference ({MIX2FLD_ROW}) describes the file's partition and is dropped" in err
    assert err.count("note:") == 1, err
    cfg, _, _ = parse_args(["--config", MIX2FLD_FILE, "--partition", "skewed:0:0:13", "--channel", "symmetric"])
    assert cfg.reference == {}
    assert (f"its reference ({MIX2FLD_ROW}) describes the file's partition, channel and is dropped"
            in capsys.readouterr().err)
    cfg, _, _ = parse_args(["--config", MIX2FLD_FILE, "--inverse-per-device", "20"])  # N_I = 20: another row
    assert cfg.reference == {}
    assert f"({MIX2FLD_ROW}) describes the file's algo_options and is dropped" in capsys.readouterr().err
    # a replaced algorithm keeps --algo's wording, and names the other settings changed with it
    cfg, _, _ = parse_args(["--config", MIX2FLD_FILE, "--algo", "mixfld", "--partition", "iid"])
    assert cfg.reference == {}
    assert (f"its reference ({MIX2FLD_ROW}) is mix2fld's, describes the file's partition and is dropped"
            in capsys.readouterr().err)
    # the seed, settings outside the identity and the file's own values (however spelled): kept, nothing said
    for extra in (["--seed", "3"], ["--rounds", "5", "--eval-every", "5", "--threads", "1", "--checkpoint-every", "0"],
                  ["--partition", "Skewed:02:1:13", "--channel", "asymmetric", "--inverse-per-device", "100",
                   "--lr", "0.050", "--model", "MLP"]):
        cfg, _, _ = parse_args(["--config", MIX2FLD_FILE] + extra)
        assert cfg.reference["row"] == MIX2FLD_ROW and capsys.readouterr().err == "", extra
    # a setting the file leaves at its default is the default's: naming it is no change, another value is
    path = write(tmp_path, "ref.yaml", "algo: fedprox\nreference: {paper: P, row: FedProx row, value: 1.0}\n")
    cfg, _, _ = parse_args(["--config", path, "--partition", "auto", "--mu", "0.01"])
    assert cfg.reference and capsys.readouterr().err == ""
    cfg, _, _ = parse_args(["--config", path, "--optimizer", "adam"])
    assert cfg.reference == {}
    assert "its reference (FedProx row) describes the file's optimizer and is dropped" in capsys.readouterr().err
    # values are read as the launcher reads them: YAML reads `lr: 5e-2` as the string '5e-2', the run 0.05
    path = write(tmp_path, "ref2.yaml", "algo: fedprox\nlr: 5e-2\nmomentum: 0\nreference: {row: FedProx row}\n")
    for extra in ([], ["--lr", "0.05", "--momentum", "0.0"]):
        cfg, _, _ = parse_args(["--config", path] + extra)
        assert cfg.lr == 0.05 and cfg.reference and capsys.readouterr().err == "", extra


def test_rounds_drop_a_reference_only_for_an_algorithm_whose_updates_read_them(tmp_path, capsys):
    """pMixFed's schedule reads the total rounds (identity_settings, which its checkpoints hold):
    the pMixFed table file at --rounds 20 is another setting than the row's T = 100, so the row is
    dropped and said. FedAvg's rounds only say how long the same setting runs: kept."""
    from fedhpc.config import identity_changes

    capsys.readouterr()
    cfg, _, _ = parse_args(["--config", PMIXFED_TABLE_FILE, "--rounds", "20"])
    assert cfg.rounds == 20 and cfg.reference == {}
    assert "its reference (pMixFed, CIFAR-10, CNN, N=10, C=100%) describes the file's rounds and is dropped" \
        in capsys.readouterr().err
    for extra in (["--rounds", "100"], ["--seed", "2"]):  # the file's own value, and the seed: kept
        cfg, _, _ = parse_args(["--config", PMIXFED_TABLE_FILE] + extra)
        assert cfg.reference and capsys.readouterr().err == "", extra
    path = write(tmp_path, "ref.yaml", "algo: fedavg\nrounds: 100\nreference: {row: FedAvg row}\n")
    cfg, _, _ = parse_args(["--config", path, "--rounds", "20"])
    assert cfg.reference and capsys.readouterr().err == ""
    # spelled as the launcher reads it; another algorithm is named alone (its rounds belong to it)
    assert identity_changes({"algo": "pmixfed", "rounds": 100}, {"algo": "PMixFed", "rounds": "100"}) == []
    assert identity_changes({"algo": "pmixfed"}, {"algo": "pmixfed", "rounds": 30}) == ["rounds"]  # default 20
    assert identity_changes({"algo": "pmixfed", "rounds": 100}, {"algo": "fedavg", "rounds": 20}) == ["algo"]
    assert identity_changes({"algo": "pmixfed_dynamic", "rounds": 100}, {"algo": "pmixfed_dynamic", "rounds": 20}) == []


def test_algo_flag_does_not_carry_over_an_option_that_means_another_thing(capsys):
    """Mix2FLD's server_lr is its server trainer's learning rate; FedAvg's is the step on the
    averaged update (1.0 = plain FedAvg): --algo fl on the Mix2FLD file must not step by 0.05."""
    from fedhpc.algorithms.fedavg import FedAvgOptions

    cfg, ao, _ = parse_args(["--config", MIX2FLD_FILE, "--algo", "fl"])
    assert cfg.algo == "fedavg" and cfg.algo_options == {} and ao.server_lr == FedAvgOptions().server_lr == 1.0
    err = capsys.readouterr().err
    assert "server_lr=0.05 not carried over (fedavg's option of that name means another thing" in err
    assert "its default applies; --server-lr sets it" in err
    assert "seeds_per_device" in err and "dropped (fedavg has no such option)" in err
    # set on the command line, it is the user's
    _, ao, _ = parse_args(["--config", MIX2FLD_FILE, "--algo", "fl", "--server-lr", "0.5"])
    assert ao.server_lr == 0.5
    # the same option of the same method family still carries over
    cfg, ao, _ = parse_args(["--config", MIX2FLD_FILE, "--algo", "fld"])
    assert ao.server_lr == 0.05 and ao.seeds_per_device == 50
    assert "server_lr=0.05" in capsys.readouterr().err.split("carried over")[0]


XORMIXFL_FILE = os.path.join(REPO, "launch", "xormixfl_digits.yaml")


def test_fld_and_the_one_shot_server_trainers_do_not_share_server_lr(capsys):
    """FLD's server_lr (Mix2FLD, MixFLD) is plain SGD's eta on Eq. 5, K_s steps a round; the one-shot
    server trainers' (XorMixFL, MixFL) is --server-optimizer's rate, Adam's 1e-3: --algo xormixfl over
    the Mix2FLD file trained its server with Adam at 0.05, and --algo mix2fld over a XorMixFL file
    took SGD steps of 0.001. Options of one meaning still carry over (server_batch, a batch size)."""
    from fedhpc.algorithms.fld import FLDOptions
    from fedhpc.algorithms.oneshot import EncodingOptions

    capsys.readouterr()
    _, ao, _ = parse_args(["--config", MIX2FLD_FILE, "--algo", "xormixfl"])
    assert ao.server_lr == EncodingOptions().server_lr == 0.001 and ao.server_batch == 32
    assert "server_lr=0.05 not carried over (xormixfl's option of that name means another thing" \
        in capsys.readouterr().err
    _, ao, _ = parse_args(["--config", XORMIXFL_FILE, "--algo", "mix2fld"])
    assert ao.server_lr == FLDOptions().server_lr == 0.01 and ao.server_batch == 256
    assert "server_lr=0.001 not carried over (mix2fld's option" in capsys.readouterr().err
    # within each family it is one field: carried over
    _, ao, _ = parse_args(["--config", XORMIXFL_FILE, "--algo", "mixfl"])
    assert ao.server_lr == 0.001


# --------------------------------------------------------------------------- channel options at parse time

@pytest.mark.parametrize("argv,words", [
    (["--channel", "asymmetric", "--channel-opt", "p_up_dbmm=30"],
     "channel 'asymmetric' has no option(s) ['p_up_dbmm'] (did you mean 'p_up_dbm'?)"),
    (["--channel", "symmetric", "--channel-opt", "t_max_s=0"], "channel option t_max_s must be a positive number"),
    (["--channel", "symmetric", "--channel-opt", "theta_unit=dB"], "theta_unit must be 'linear' or 'db'"),
])
def test_channel_options_are_checked_when_parsed_not_when_the_run_starts(monkeypatch, argv, words):
    def no_engine(*a, **k):
        raise AssertionError("the engine was built before the channel options were checked")

    monkeypatch.setattr("fedhpc.engine.Engine.__init__", no_engine)
    with pytest.raises(ConfigError) as e:
        parse_args(TINY + argv)
    assert words in str(e.value)


def test_channel_options_in_yaml_and_sweep_points_are_checked_up_front(tmp_path, capsys):
    path = write(tmp_path, "c.yaml", "channel: asymmetric\nchannel_options: {p_up_dbmm: 30}\n")
    with pytest.raises(ConfigError, match=r"has no option\(s\) \['p_up_dbmm'\] \(did you mean 'p_up_dbm'\?\)"):
        parse_args(["--config", path])
    grid = write(tmp_path, "g.yaml", yaml.safe_dump({
        "base": {**GRID_BASE, "channel": "asymmetric"},
        "axes": {"channel_options.p_up_dbmm": [None, 30]}, "out": str(tmp_path / "sweep")}))
    assert sweep_main([grid, "--local", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "1 of 2 point(s) fail validation" in err and "p_up_dbmm" in err
    assert not (tmp_path / "sweep").exists()
    # valid options pass, with a channel model
    cfg, _, _ = parse_args(TINY + ["--channel", "asymmetric", "--channel-opt", "p_up_dbm=30"])
    assert cfg.channel_options == {"p_up_dbm": 30}


@pytest.mark.parametrize("argv", [["--channel-opt", "p_up_dbm=30"],
                                  ["--channel", "none", "--channel-opt", "t_max_s=0.2"]])
def test_channel_options_without_a_channel_model_are_refused_not_ignored(argv):
    with pytest.raises(ConfigError) as e:
        parse_args(TINY + argv)
    msg = str(e.value)
    name = argv[-1].split("=")[0]
    assert f"channel option(s) {name} are set but --channel is none" in msg
    assert "--channel symmetric or asymmetric" in msg


def test_channel_none_over_a_files_channel_model_drops_its_options_saying_so(tmp_path, capsys):
    """The ideal-link twin of a channel file: --channel none (or a sweep axis) takes the file's
    channel_options with its channel model instead of refusing a run nothing can fix."""
    path = write(tmp_path, "c.yaml", "channel: asymmetric\nchannel_options: {p_up_dbm: 30}\n")
    cfg, _, _ = parse_args(["--config", path, "--channel", "none"] + TINY)
    assert cfg.channel == "none" and cfg.channel_options == {}
    assert "its channel_options (p_up_dbm=30) parametrise its channel asymmetric and are dropped" in \
        capsys.readouterr().err
    # the file's own model keeps them; options given for no channel are still refused
    assert parse_args(["--config", path] + TINY)[0].channel_options == {"p_up_dbm": 30}
    with pytest.raises(ConfigError, match="are set but --channel is none"):
        parse_args(["--config", path, "--channel", "none", "--channel-opt", "t_max_s=0.2"] + TINY)
    own = write(tmp_path, "n.yaml", "channel: none\nchannel_options: {p_up_dbm: 30}\n")
    with pytest.raises(ConfigError, match="are set but --channel is none"):
        parse_args(["--config", own, "--channel", "none"] + TINY)

    grid = write(tmp_path, "g.yaml", yaml.safe_dump({
        "config": path, "base": GRID_BASE, "axes": {"channel": ["none", "asymmetric"]},
        "out": str(tmp_path / "sweep")}))
    none, model = expand(load_grid(grid))
    assert "channel_options" not in none.settings and none.config.channel_options == {}
    assert model.config.channel_options == {"p_up_dbm": 30}
    # options the point itself sets for no channel are its mistake: refused, not dropped
    grid = write(tmp_path, "z.yaml", yaml.safe_dump({
        "config": path, "base": GRID_BASE, "out": str(tmp_path / "sweep"),
        "zip": {"channel_options.t_max_s": [0.2], "channel": ["none"]}}))
    with pytest.raises(ConfigError, match="are set but --channel is none"):
        expand(load_grid(grid))


# --------------------------------------------------------------------------- momentum with Adam

def test_momentum_with_adam_is_refused_naming_the_fix():
    with pytest.raises(ConfigError) as e:
        parse_args(TINY + ["--optimizer", "adam", "--momentum", "0.9"])
    msg = str(e.value)
    assert "--momentum 0.9 has no effect with --optimizer adam" in msg and "--optimizer sgd" in msg
    parse_args(TINY + ["--optimizer", "adam", "--momentum", "0"])
    parse_args(TINY + ["--optimizer", "sgd", "--momentum", "0.9"])


#: option names several methods define, where those not marked method_specific mean one thing
#: (the mixup methods' lam is one mixing ratio; FLD's and the server trainers' server_batch both a
#: server trainer's batch size); a name not listed here must be marked on every definition whose
#: meaning is its method's own (server_lr: FedAvg's step, FLD's SGD eta, the one-shot trainers' Adam rate)
SHARED_MEANING = {"beta", "finetune_epochs", "lam", "mix_alpha", "prox_mu", "select", "server_batch",
                  "server_micro_batch", "server_momentum"}


def test_every_option_name_shared_by_methods_is_declared_one_meaning_or_method_specific():
    """--algo carries a file's option to another method when the names match (config's
    _same_meaning): a new method reusing a name for another thing (a fifth 'mu') must say so."""
    from dataclasses import fields

    from fedhpc.algorithms import ALGORITHMS, load_algorithm_modules
    from fedhpc.config import METHOD_SPECIFIC
    load_algorithm_modules()
    definitions = {}
    for name in ALGORITHMS.names():
        options = ALGORITHMS.get(name).Options
        for f in fields(options) if options is not None else ():
            definitions.setdefault(f.name, {})[id(f)] = f
    undeclared = sorted(n for n, defs in definitions.items()
                        if sum(not f.metadata.get(METHOD_SPECIFIC) for f in defs.values()) > 1
                        and n not in SHARED_MEANING)
    assert not undeclared, f"options defined by several methods, neither one meaning nor method_specific: {undeclared}"
    assert {n for n in SHARED_MEANING if len(definitions.get(n, {})) > 1} == SHARED_MEANING  # no stale entry


def test_per_label_accuracy_of_a_method_without_a_global_model_is_refused(capsys, tmp_path):
    """--per-label-accuracy is the global model's, per label; FD trains none, and the flag would
    silently report nothing."""
    err = refused(["--algo", "fd", "--per-label-accuracy", *TINY], capsys, tmp_path)
    assert err == ("error: --per-label-accuracy reports the global model's accuracy per label, and fd trains no "
                   "global model (its devices keep their own: local_test_accuracy*, reference_device_accuracy); "
                   "drop the flag\n"), err
