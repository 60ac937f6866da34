"""Where FLD's output-to-model conversion starts each round (issue 39 s.2 item 5; Mix2FLD paper
Sec. I: the server distils "to an untrained student model (i.e., a global model)").

``--server-init previous`` (default, what the code always did): the conversion continues from the
global model it broadcast last round. ``initial``: from the run's initial model every round, the
paper's untrained student. The default stays: on digits' bare run (K_s = 50 a round) Mix2FLD
reaches 83% from the previous model and stays at chance (9.8%) from the initial one, whose K_s
steps must train a whole model from scratch each round (fedhpc/algorithms/distillation/fld.py)."""

from __future__ import annotations

import pytest
import torch

from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.errors import ConfigError
from fedhpc.server.trainer import ServerTrainer
from fedhpc.world import World

ARGS = ["--model", "mlp", "--model-opt", "hidden=16", "--num-clients", "4", "--clients-per-round", "4",
        "--seeds-per-device", "4", "--inverse-per-device", "4", "--server-steps", "3", "--server-batch", "4",
        "--threads", "1", "--quiet", "--no-tensorboard", "--no-out"]


def starts(algo, monkeypatch, *extra, rounds=2):
    """The model each round's conversion started from, the initial model, and each round's result."""
    seen = []
    fit = ServerTrainer.fit

    def recorded(self, *a, **kw):
        seen.append(self.flat.flat.detach().clone())
        return fit(self, *a, **kw)

    monkeypatch.setattr(ServerTrainer, "fit", recorded)
    eng = Engine(*parse_args(["--algo", algo, *ARGS, *extra]), World(threads=1))
    initial = eng.global_state.clone()
    ends = []
    try:
        for t in range(rounds):
            eng.run_round(t)
            ends.append(eng.global_state.clone())
    finally:
        eng.client_state.close()
        eng.data.close()
    return seen, initial, ends, eng.algo.options


@pytest.mark.parametrize("algo", ["fld", "mixfld", "mix2fld"])
def test_the_conversion_starts_from_the_previous_global_model_by_default(algo, monkeypatch):
    seen, initial, ends, options = starts(algo, monkeypatch)
    assert options.server_init == "previous" and len(seen) == 2
    # round 1 starts where the run starts; round 2 from round 1's global model, which it trained
    assert torch.equal(seen[0], initial) and torch.equal(seen[1], ends[0]) and not torch.equal(ends[0], initial)


@pytest.mark.parametrize("algo", ["fld", "mix2fld"])
def test_server_init_initial_converts_into_the_untrained_model_every_round(algo, monkeypatch):
    seen, initial, ends, options = starts(algo, monkeypatch, "--server-init", "initial", rounds=3)
    assert options.server_init == "initial" and len(seen) == 3
    assert all(torch.equal(s, initial) for s in seen)
    assert not torch.equal(ends[1], initial)


def test_server_init_is_refused_unless_previous_or_initial_and_its_help_names_the_papers_reading(capsys):
    with pytest.raises(ConfigError, match="--server-init must be one of previous, initial"):
        parse_args(["--algo", "fld", "--server-init", "fresh"])
    with pytest.raises(SystemExit):
        parse_args(["--algo", "mix2fld", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--server-init STR where each round's conversion starts: previous (the global model, warm: what trains)" \
        in text
    assert "initial (the run's initial model every round: the paper's 'untrained student')" in text
