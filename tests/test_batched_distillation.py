"""Batched clients (``--clients-at-once``) for the FD family: FD, FLD, MixFLD and Mix2FLD.

What a device does in a round is the same in both paths: it trains its model (FD: its own, kept
in the client-state store; FLD family: the global one) on CE (+ beta psi against its own teacher
row for FD) while adding its softmax outputs to its per-label sums (Eq. 2). The batched path adds
all K devices' outputs with one index_add_ into a stacked table whose slices are the devices' own
sums, and computes each device's distillation term from its own teacher: the one broadcast, or
the table it kept when its downlink failed. Each is checked against the per-device computation,
and whole rounds against the sequential run (the main job's launch file on the launcher too).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from fedhpc.exchanges import label_outputs
from test_batched import (TOL, assert_close_or_discrete, assert_own_models_equal, assert_rounds_equal,
                          rounds_envelope, run_rounds)
from test_batched_more import BOTH

#: beta large enough that the distillation term moves the devices' models visibly
FD_OPTIONS = {"beta": 0.5}
#: the FLD family with a short server conversion (K_s = 20 steps): the devices' training is what is batched
FLD_OPTIONS = {"seeds_per_device": 10, "server_steps": 20, "server_batch": 16, "server_lr": 0.05}


def test_group_outputs_are_each_devices_own_sums():
    """GroupLabelOutputs against one LabelOutputs per device fed its unpadded rows: padding adds
    nothing, each device's sums and counts are its own, and they stay the devices' own objects."""
    g = torch.Generator().manual_seed(0)
    k, b, c = 3, 6, 5
    real = [6, 2, 0]  # a full batch, a short one, a device masked out of the step
    own = [label_outputs.LabelOutputs(c, "cpu") for _ in range(k)]
    ref = [label_outputs.LabelOutputs(c, "cpu") for _ in range(k)]
    stack = label_outputs.GroupLabelOutputs(own)
    for _ in range(2):  # two steps: the sums accumulate in the devices' own objects
        logits = torch.randn(k, b, c, generator=g)
        y = torch.randint(0, c, (k, b), generator=g)
        mask = torch.arange(b)[None, :] < torch.tensor(real)[:, None]
        stack.add(logits, y, mask)
        for i in range(k):
            ref[i].add(logits[i, :real[i]], y[i, :real[i]])
    for mine, theirs in zip(own, ref):
        assert torch.equal(mine.counts, theirs.counts)
        assert torch.allclose(mine.sums, theirs.sums, rtol=0, atol=1e-12)
        assert torch.equal(label_outputs.upload(mine)["label_presence"], label_outputs.upload(theirs)["label_presence"])
    assert float(own[2].counts.sum()) == 0 and float(own[0].counts.sum()) == 12


def test_group_distillation_loss_is_each_devices_term_against_its_own_teacher():
    """The broadcast table, a device's kept table, and no teacher, in one group: each device's term
    equals distillation_loss on its unpadded rows against its own table."""
    g = torch.Generator().manual_seed(1)
    k, b, c = 4, 5, 6
    real = [5, 3, 5, 1]

    def table():
        t = torch.softmax(torch.randn(c, c, generator=g, dtype=torch.float64), -1)
        mask = (torch.rand(c, generator=g) > 0.3).double()
        return t * mask[:, None], mask

    broadcast, kept = table(), table()
    logits = torch.randn(k, b, c, generator=g, requires_grad=True)
    y = torch.randint(0, c, (k, b), generator=g)
    weight = torch.tensor([[1.0 / n if i < n else 0.0 for i in range(b)] for n in real])
    for teachers in ([broadcast, kept, None, broadcast], [broadcast] * k, [None] * k):
        got = label_outputs.group_distillation_loss(logits, y, weight, teachers)
        for i, teacher in enumerate(teachers):
            if teacher is None:
                assert float(got[i].detach()) == 0.0
                continue
            rows, mask = teacher[0][y[i, :real[i]]], teacher[1][y[i, :real[i]]]
            want = label_outputs.distillation_loss(logits[i, :real[i]], rows, mask)
            assert abs(float(got[i].detach()) - float(want.detach())) <= 1e-6, (teachers, i)
    # the gradient of device i's term reaches its own logits only
    got = label_outputs.group_distillation_loss(logits, y, weight, [broadcast, kept, None, broadcast])
    (grad,) = torch.autograd.grad(got[1], logits)
    assert float(grad[1].abs().sum()) > 0 and float(grad[[0, 2, 3]].abs().sum()) == 0


def assert_devices_equal(seq, bat, m_seq, m_bat, envelope):
    """The round losses and traffic, and every device's own model (within rounding, or within the
    envelope's discrete events: see test_batched.assert_close_or_discrete); returns how many had one."""
    for a, b in zip(m_seq, m_bat):
        assert a["bytes_up"] == b["bytes_up"] and a["bytes_down"] == b["bytes_down"]
    assert_rounds_equal(seq, bat, m_seq, m_bat, envelope)
    return assert_own_models_equal(seq, bat, envelope=envelope)


@pytest.mark.parametrize("model", ["mlp", "dropout+batchnorm"])
def test_fd_rounds_equal_sequential(model):
    """Three rounds of FD through Engine.run_round: from round 1 on each device starts from its own
    model and distils from the broadcast table; every device's model, the global outputs and the
    round losses match the sequential run."""
    kw = dict(lr=0.01, momentum=0.5, **({} if model == "mlp" else BOTH))
    seq, m_seq = run_rounds(1, "fd", FD_OPTIONS, rounds=3, **kw)
    bat, m_bat = run_rounds(4, "fd", FD_OPTIONS, rounds=3, **kw)
    env = rounds_envelope(seq, "fd", FD_OPTIONS, **kw)
    assert assert_devices_equal(seq, bat, m_seq, m_bat, env) >= 6  # most devices trained, some twice
    assert seq.algo.teacher is not None
    assert_close_or_discrete(float((seq.algo.teacher[0] - bat.algo.teacher[0]).abs().max()), TOL,
                             env(lambda e: e.algo.teacher[0]), "the global outputs")


def test_fd_devices_that_missed_a_broadcast_distil_from_their_own_table():
    """Under a channel with downlink outages, a group mixes devices that distil from the broadcast
    table with devices that keep the one they had: the same models and outages as sequentially."""
    kw = dict(lr=0.01, momentum=0.5, channel="symmetric",
              channel_options={"distance_m": 2200, "t_max_s": 0.002, "num_channels": 12})
    seq, m_seq = run_rounds(1, "fd", FD_OPTIONS, rounds=4, **kw)
    bat, m_bat = run_rounds(4, "fd", FD_OPTIONS, rounds=4, **kw)
    for a, b in zip(m_seq, m_bat):
        assert a["downlink_outages"] == b["downlink_outages"] and a["uplink_outages"] == b["uplink_outages"]
    # the check means something only if some device trained on a kept table
    assert sum(m["downlink_outages"] for m in m_seq[:-1]) > 0
    assert assert_devices_equal(seq, bat, m_seq, m_bat, rounds_envelope(seq, "fd", FD_OPTIONS, rounds=4, **kw)) >= 6


@pytest.mark.parametrize("algo", ["fld", "mixfld", "mix2fld"])
def test_fld_family_rounds_equal_sequential(algo):
    """Three rounds: the devices train the global model batched (Eq. 1 + Eq. 2), the server converts
    the averaged outputs into the next global model; the global model, its outputs and the losses
    match the sequential run."""
    kw = dict(lr=0.01, momentum=0.5, **BOTH)
    seq, m_seq = run_rounds(1, algo, FLD_OPTIONS, rounds=3, **kw)
    bat, m_bat = run_rounds(4, algo, FLD_OPTIONS, rounds=3, **kw)
    for a, b in zip(m_seq, m_bat):
        assert abs(a["train_loss"] - b["train_loss"]) <= TOL
    assert float((seq.global_state - bat.global_state).abs().max()) <= 3 * TOL
    assert seq.algo.teacher is not None
    assert float((seq.algo.teacher[0] - bat.algo.teacher[0]).abs().max()) <= TOL


def test_the_main_job_batched_equals_sequential_on_the_launcher(tmp_path):
    """launch/mix2fld_digits.yaml (Mix2FLD, asymmetric channel, seeds over the channel), 3 rounds,
    --clients-at-once 5 against 1: the same outages and traffic, and the model and the reference
    device's accuracy within rounding."""
    from conftest import launch

    got = {}
    for k in (1, 5):
        out = str(tmp_path / f"k{k}")
        p = launch(["--config", "launch/mix2fld_digits.yaml", "--rounds", "3", "--server-steps", "60", "--clients-at-once", str(k),
                    "--threads", "1", "--quiet", "--no-tensorboard", "--out", out], ranks=1, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        got[k] = (torch.load(os.path.join(out, "final_model.pt")), rows)
    (seq, seq_rows), (bat, bat_rows) = got[1], got[5]
    assert len(seq_rows) == len(bat_rows) == 3
    for a, b in zip(seq_rows, bat_rows):
        for key in ("bytes_up", "bytes_down", "uplink_outages", "downlink_outages", "seeds_delivered"):
            assert a.get(key) == b.get(key), key
        assert abs(a["train_loss"] - b["train_loss"]) <= TOL
        # accuracy on digits' test split: a prediction flipped by rounding moves it by one sample
        assert abs(a["reference_device_accuracy"] - b["reference_device_accuracy"]) <= 2 / 360
    diff = max(float((seq[n].double() - bat[n].double()).abs().max()) for n in seq if seq[n].is_floating_point())
    assert diff <= 1e-4, diff
