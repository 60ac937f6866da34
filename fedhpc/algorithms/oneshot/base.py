"""The one-shot family of the XorMixFL paper (003: XOR Mixup, Shin et al. 2020): shared pieces.

Setting (paper Sec. 3). The server holds an imbalanced base dataset of its own (the
``server_*`` data options: e.g. 200 samples per label, 10 of each *target* label) and
devices hold theirs. In the one communication round the server announces its target
labels and asks the devices for encoded samples of them; it turns what arrives into
training samples, adds them until every label has as many samples as its largest
label (balanced), trains the global model on the result with the data-parallel
:class:`fedhpc.server.trainer.ServerTrainer` (every rank works), and broadcasts it.
Devices do no local training. The members differ only in what the server adds
(:meth:`OneShotServer.augmented_set`): nothing (``standalone``), XOR-decoded samples
(``xormixfl``), mixup samples with soft labels (``mixfl``).

Pieces, as pure functions the tests check against hand computations:

* Encoding and decoding (:mod:`fedhpc.algorithms.oneshot.sample_codecs`): the uint8 pixel domain,
  Eq. 1's blending, XOR encoding (Eq. 2) and decoding (Eq. 3), MixFL's mixup encoding.
* Balancing (:func:`balance_deficits`, :func:`split_requests`): target count = the
  largest label's count on the server; each target label's deficit is split evenly over
  the devices that hold the label (in device order, the first ``deficit mod K`` ask
  one more), or every such device is asked ``requests_per_device`` and the server keeps
  the first ``deficit`` it decodes, in (device, position) order.

Readings where the text is silent: encoded samples are collected from *every* device
once, in the first round (the one-shot round); later rounds, if any are run, change
nothing. Which labels a device holds is announced with the request (label ids, no
data; not booked). The upload books 1 byte per pixel plus 1 byte per label id; the
broadcast books the model once per device of the round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...analysis.privacy import audit_raw_leaves, mds_min_distances, pixel_min_distances
from ...errors import ConfigError, DataError
from ...exchanges.ownership import canonical_order
from ...server.trainer import ServerTrainConfig, ServerTrainer
from ..base import Algorithm, derive_seed
from .sample_codecs import BLEND_RULES, EncodedSet, encode_device, to_pixels

# --------------------------------------------------------------------------- balancing


def balance_deficits(counts: Sequence[int]) -> Dict[int, int]:
    """label -> samples it lacks to reach the largest label's count (target labels only)."""
    counts = [int(c) for c in counts]
    top = max(counts) if counts else 0
    return {c: top - n for c, n in enumerate(counts) if n < top}


def split_requests(deficit: int, holders: Sequence[int], per_device: int = 0) -> Dict[int, int]:
    """cid -> encoded samples of one target label asked of it.

    ``per_device`` > 0: that many of every holder; else the deficit split evenly over the
    holders in device order (the first ``deficit mod K`` holders ask one more)."""
    holders = sorted(int(c) for c in holders)
    if not holders or deficit <= 0:
        return {}
    if per_device > 0:
        return {c: per_device for c in holders}
    q, r = divmod(deficit, len(holders))
    return {c: q + (1 if i < r else 0) for i, c in enumerate(holders) if q + (1 if i < r else 0) > 0}


def keep_until_balanced(target: torch.Tensor, deficits: Dict[int, int]) -> torch.Tensor:
    """Rows to add: the first ``deficits[t]`` samples of each target label t, in the set's order."""
    keep, taken = [], {t: 0 for t in deficits}
    for i, t in enumerate(target.tolist()):
        if taken.get(t, 0) < deficits.get(t, 0):
            keep.append(i)
            taken[t] += 1
    return torch.tensor(keep, dtype=torch.long)


# --------------------------------------------------------------------------- options


@dataclass
class ServerTrainingOptions:
    """How the server trains on its (reconstructed) dataset; the authors: Adam, 100 epochs, batch 256."""

    server_epochs: int = field(default=100, metadata={"help": "passes over the server's dataset (authors: 100)"})
    server_batch: int = field(default=256, metadata={"help": "server batch size (authors: 256)"})
    # method_specific: --server-optimizer's learning rate (Adam by default), not FLD's plain-SGD eta
    # (0.01-0.05 in the Mix2FLD files: as Adam's rate it trains another model) nor FedAvg's step
    server_lr: float = field(default=0.001, metadata={"help": "server learning rate (Adam's default 1e-3)",
                                                      "method_specific": True})
    server_optimizer: str = field(default="adam", metadata={"help": "adam (authors) or sgd"})
    server_momentum: float = field(default=0.0, metadata={"help": "SGD momentum of the server"})
    server_weight_decay: float = field(default=0.0, metadata={"help": "server L2 weight decay"})
    server_micro_batch: int = field(default=32, metadata={
        "help": "samples per micro-batch of the data-parallel server step (fixed: results do not depend on ranks)"})

    def validate(self):
        self.train_config(1).validate()

    def train_config(self, n: int) -> ServerTrainConfig:
        return ServerTrainConfig(epochs=self.server_epochs, batch_size=min(self.server_batch, max(n, 1)),
                                 micro_batch=self.server_micro_batch, lr=self.server_lr,
                                 optimizer=self.server_optimizer, momentum=self.server_momentum,
                                 weight_decay=self.server_weight_decay)


@dataclass
class EncodingOptions(ServerTrainingOptions):
    """The devices' encoding (Table 4's grid: number of dummy labels, alpha, M) and the privacy measure."""

    num_dummy: int = field(default=1, metadata={"help": "dummy labels per encoded sample (Table 4: 1, 2, 3)"})
    blend_alpha: float = field(default=0.5, metadata={
        "help": "alpha of the pairwise sample blending, Eq. 1 (Table 4: 0.25, 0.5, 0.95; authors 0.5); blends "
                "nothing at --max-blend 1 (XorMixFL), where MixFL still mixes target and dummies with it"})
    max_blend: int = field(default=2, metadata={
        "help": "M: samples blended per label (1 = none; Table 4: 1, 5; authors 2)"})
    blend_rule: str = field(default="average", metadata={
        "help": "how a label's up-to-M samples become one: average (Eq. 1, iterated pairwise with "
                "--blend-alpha; the paper's text, the authors' 0.5/0.5) or saturating_sum (min(255, sum); "
                "not the paper's text, the one reading found under which Table 3's distances grow with M)"})
    dummy_labels: str = field(default="", metadata={
        "help": "labels dummies are drawn from, comma separated (Table 4 fixes them); empty = any non-target label"})
    requests_per_device: int = field(default=0, metadata={
        "help": "encoded samples asked of every holder per target label (0 = the deficit split evenly)"})
    privacy_samples: int = field(default=200, metadata={
        "help": "augmented samples whose privacy (MDS / pixel distance) is measured, a seeded subset (0 = off)"})
    mds_dims: int = field(default=2, metadata={
        "help": "dimensions of the classical MDS embedding behind privacy_mds_* (Table 3 gives none; 2-D shrinks "
                "distances by 30-40%% on digits, privacy_pixel_* is the full-dimensional twin)"})

    def validate(self):
        super().validate()
        if self.num_dummy < 1:
            raise ConfigError(f"--num-dummy must be >= 1, got {self.num_dummy}")
        if not 0 <= self.blend_alpha <= 1:
            raise ConfigError(f"--blend-alpha must be in [0, 1], got {self.blend_alpha}")
        if self.max_blend < 1:
            raise ConfigError(f"--max-blend must be >= 1 (1 = no blending), got {self.max_blend}")
        if self.blend_rule not in BLEND_RULES:
            raise ConfigError(f"--blend-rule must be one of {', '.join(BLEND_RULES)}, got {self.blend_rule!r}")
        if self.requests_per_device < 0 or self.privacy_samples < 0:
            raise ConfigError("--requests-per-device and --privacy-samples must be >= 0")
        if self.mds_dims < 1:
            raise ConfigError(f"--mds-dims must be >= 1, got {self.mds_dims}")
        pool = self.dummy_pool()
        if pool is not None and len(pool) < self.num_dummy:
            raise ConfigError(f"--dummy-labels {self.dummy_labels!r} lists {len(pool)} label(s), fewer than "
                              f"--num-dummy {self.num_dummy}; list at least that many")

    def inert_options(self) -> Tuple[str, ...]:
        """Options that cannot change this run's numbers given the others: alpha at M = 1, where the
        blend of one sample is that sample (Eq. 1) and XOR takes no ratio (Eqs. 2-3), or where the
        blend is a saturating sum, which takes none either; the blend rule at M = 1. Two runs whose
        settings differ only in these are the same run (tests/test_launch_configs.py holds the
        launch files to it)."""
        if self.max_blend == 1:
            return ("blend_alpha", "blend_rule")
        return ("blend_alpha",) if self.blend_rule == "saturating_sum" else ()

    def dummy_pool(self) -> Optional[List[int]]:
        """The labels dummies may come from, or None for any non-target label."""
        text = str(self.dummy_labels).strip().strip("[]()")
        if not text:
            return None
        try:
            return sorted({int(v) for v in text.split(",") if v.strip()})
        except ValueError:
            raise ConfigError(f"--dummy-labels must be comma-separated integer labels, got {self.dummy_labels!r}")


# --------------------------------------------------------------------------- the family's algorithm


class OneShotServer(Algorithm):
    """Standalone's behaviour: the server trains on its own base set once; devices do nothing.

    Subclasses add samples to the server's set (:meth:`augmented_set`). The set is built
    in the first round's ``round_begin`` (collective: gathers the devices' uploads) and
    the model trained in that round's ``aggregate``; the global model is the server's.
    """

    Options = ServerTrainingOptions
    ledger_kinds = ("parameters", "encoded")
    #: the server base set of a run that gives no ``server_*`` data option (:mod:`fedhpc.config.auto`):
    #: the digits twin of the paper's Table 2, target label 0 (``launch/xormixfl_digits.yaml``): 40
    #: images of every label and 2 of the target label, the paper's 1:20 (its MNIST setting, 200 and
    #: 10, is in ``launch/xormixfl_mnist_*.yaml``). Every in-memory dataset here holds that much
    #: (digits about 143 per label, mnist5k 400); the devices share out the rest of the pool
    auto_data_options = {"server_per_label": 40, "server_deficient": "0", "server_deficient_count": 2}
    auto_data_options_why = "the server's base set: XorMixFL Table 2's 1:20, target label 0, at digits scale"
    #: run settings of a run that sets none of them (:mod:`fedhpc.config.auto`): one round, as the
    #: launch files have it: the model is trained in the first round, later rounds change nothing
    auto_settings = {"rounds": (1, "one-shot: the server trains once, in the first round")}
    #: whether uploads are linear mixes of raw samples (recoverable given one part): the audit's flag
    linear_mix = False
    #: why --clients-at-once > 1 is refused (fedhpc.batched.check_batchable)
    not_batchable_because = "one-shot: devices do not train (they encode once; the server trains)"

    def setup(self):
        self.options = self.options or self.Options()
        server = self.data.server_data()
        if server is None:
            raise ConfigError(f"--algo {self.name} trains on the server's own base set; give it one with "
                              f"--data-opt server_per_label=N (and server_deficient=L1,L2 "
                              f"--data-opt server_deficient_count=n for its target labels)")
        self.server_x, self.server_y = server
        self.num_classes = self.data.num_classes
        pool = getattr(self.options, "dummy_pool", lambda: None)()
        outside = sorted(label for label in pool or () if not 0 <= label < self.num_classes)
        if outside:  # found here, on every rank alike, not per device while encoding
            raise ConfigError(f"--dummy-labels {self.options.dummy_labels!r} names label(s) {outside} that "
                              f"{self.cfg.dataset} does not have (its labels are 0..{self.num_classes - 1}); "
                              f"list labels in that range")
        self.trainer = ServerTrainer(self.comm, self.model, self.flat)
        self.train_set: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.upload_bytes: Dict[int, int] = {}
        self.metrics: Dict[str, float] = {}

    # ---------------------------------------------------------------- devices: nothing to train
    def local_update(self, model, ctx):
        """One-shot: devices only encode (done once in round_begin); no local training."""

    def upload_spec(self):
        return {}

    def upload(self, model, ctx):
        if ctx.round.index == 0 and self.upload_bytes.get(ctx.cid):
            ctx.ledger.add("up", "encoded", self.upload_bytes[ctx.cid])
        return {}

    # ---------------------------------------------------------------- the server's set (once)
    def server_counts(self) -> List[int]:
        return torch.bincount(self.server_y, minlength=self.num_classes).tolist()

    def augmented_set(self, rnd) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(x in stored form, training targets, target label of each) the server adds to its base
        set; None for standalone. The label counts balancing is judged by (a MixFL soft label's
        argmax can be a dummy's at lam = 0.5)."""
        return None

    def base_targets(self) -> torch.Tensor:
        return self.server_y

    def round_begin(self, rnd):
        if rnd.index != 0 or self.train_set is not None:
            return
        added = self.augmented_set(rnd)
        x, y, labels = self.server_x, self.base_targets(), self.server_y
        if added is not None:
            x, y = torch.cat([x, added[0].to(x.dtype)]), torch.cat([y, added[1].to(y.dtype)])
            labels = torch.cat([labels, added[2]])
        self.train_set = (x, y)
        counts = torch.bincount(labels, minlength=self.num_classes)
        self.metrics.update(server_base_samples=float(len(self.server_y)), server_train_samples=float(len(y)),
                            server_balanced=float(bool((counts == counts.max()).all())))
        if rnd.index == 0 and self.comm.rank == 0:
            # devices not sampled in this round uploaded too: booked once here (the ledger is summed)
            self.ledger.add("up", "encoded", sum(b for c, b in self.upload_bytes.items() if c not in rnd.sampled))

    # ---------------------------------------------------------------- the server trains once
    def aggregate(self, global_state, totals, weight_total, rnd):
        if rnd.index != 0:
            return global_state  # one-shot: the model was trained in the first round
        x, y = self.train_set
        self.flat.load_(global_state)
        fit = self.trainer.fit(x, y, self.options.train_config(len(y)),
                               seed=derive_seed(self.cfg.seed, "oneshot-server-train"),
                               transform=self.data.transform)
        self.metrics["server_train_loss"] = float(fit["loss"])
        self.server_trained_samples = float(fit.get("samples", 0.0))  # epochs x set: the channel's compute model counts them
        self.train_set = None  # not needed again; a resumed run never rebuilds it
        return self.flat.flat.detach().clone()

    def extra_metrics(self):
        return dict(self.metrics)

    def state_dict(self):
        return {"metrics": dict(self.metrics)}

    def load_state_dict(self, state):
        self.metrics = dict(state.get("metrics", {}))


class EncodedUploads(OneShotServer):
    """A one-shot server that collects encoded samples of its target labels from every device."""

    Options = EncodingOptions
    kind = "xor"

    def setup(self):
        super().setup()
        counts = self.server_counts()
        if not balance_deficits(counts):  # refused here: the devices would be asked for nothing
            raise ConfigError(f"--algo {self.name} collects encoded samples of the labels the server's base set "
                              f"lacks, but that set holds {counts[0]} of every label, so it lacks none; name its "
                              f"target labels with --data-opt server_deficient=L1,L2 --data-opt "
                              f"server_deficient_count=n (n < server_per_label)")
        try:  # the devices' inputs come from the same dataset: refused here, not in round 1
            to_pixels(self.server_x)
        except DataError as e:
            raise ConfigError(f"--algo {self.name} encodes image pixels, which dataset {self.cfg.dataset!r} does "
                              f"not hold: {e}; use a dataset stored as pixels (uint8, or floats in [0, 1]), e.g. "
                              f"--dataset digits or mnist") from None

    def mix_ratio(self) -> float:
        """MixFL's ratio on the target blend; XOR encoding takes none (unused)."""
        return 0.5

    def device_pixels(self, cid: int) -> Tuple[torch.Tensor, torch.Tensor]:
        c = self.data.client(cid)
        return to_pixels(c.x), c.y

    def collect(self, rnd) -> Tuple[EncodedSet, Dict[int, int]]:
        """Alg. 1 on every device (each rank its share), gathered in (device, position) order."""
        comm, o = self.comm, self.options
        deficits = balance_deficits(self.server_counts())
        targets = sorted(deficits)
        mine = self.hosted_training_clients()  # a cold-start client uploads nothing
        held = {cid: sorted(set(self.data.client(cid).y.tolist()) & set(targets)) for cid in mine}
        holders: Dict[int, List[int]] = {t: [] for t in targets}
        for part in comm.all_gather_object(held):
            for cid, labels in part.items():
                for t in labels:
                    holders[t].append(cid)
        asks = {t: split_requests(deficits[t], holders[t], o.requests_per_device) for t in targets}
        local, leaked, failure = [], 0, None
        try:
            for cid in mine:
                req = {t: asks[t].get(cid, 0) for t in targets}
                if not any(req.values()):
                    continue
                pixels, labels = self.device_pixels(cid)
                g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "oneshot-encode", cid))
                enc = encode_device(pixels, labels, req, targets, o.num_dummy, o.max_blend, o.blend_alpha, g,
                                    cid, kind=self.kind, lam=self.mix_ratio(),
                                    num_classes=self.num_classes, dummy_pool=o.dummy_pool(), rule=o.blend_rule)
                # The audit runs where the device's raw data already is (its hosting rank), so no rank
                # loads every device; uint8 samples are equal when their distance is below 1.
                leaked += len(audit_raw_leaves(enc, {cid: pixels}, atol=0.5, rtol=0.0).leaked_rows) if len(enc) else 0
                local.append(enc)
        except Exception as e:  # noqa: BLE001 - a device only this rank hosts: raised on every rank below
            failure = e
        # one joined set per rank: pickling a set per device costs seconds at thousands of devices
        joined_here = EncodedSet.cat(local) if any(len(e) for e in local) else None
        parts = comm.all_gather_object((joined_here, leaked, failure is not None))
        if any(failed for _, _, failed in parts):
            comm.raise_together(failure, "encoding the devices' uploads")
        enc = EncodedSet.cat([part for part, _, _ in parts if part is not None])
        enc = enc.select(canonical_order(enc.owner, enc.index))  # (device, position): any number of ranks
        self.metrics.update(uploads_equal_raw=float(sum(n for _, n, _ in parts)),
                            upload_linear_mix=float(self.linear_mix))
        per_device = torch.bincount(enc.owner, minlength=self.data.num_clients).tolist()
        for cid, count in enumerate(per_device):
            if count:
                self.upload_bytes[cid] = count * enc.row_bytes()
        self.metrics.update(encoded_uploaded=float(len(enc)), target_labels=float(len(targets)))
        if enc.blend_sizes is not None:
            # the M a run actually blends: "up to M" samples of a label, so a device holding fewer
            # target samples than --max-blend blends all it holds (M's axis stops there)
            self.metrics.update(blend_target_mean=float(enc.blend_sizes[:, 0].double().mean()),
                                blend_dummy_mean=float(enc.blend_sizes[:, 1:].double().mean()))
        return enc, deficits

    def measure_privacy(self, enc: EncodedSet, augmented: torch.Tensor, kept: torch.Tensor) -> None:
        """Table 3's distances of the added samples (the raw-leak audit ran in :meth:`collect`).

        ``augmented``: uint8 samples the server adds, rows ``kept`` of ``enc``. Distances are
        in uint8 pixel units against the owner's rows blended into each (target and dummies),
        on a seeded subset of ``privacy_samples``; identical on every rank."""
        o = self.options
        if o.privacy_samples == 0 or len(kept) == 0:
            return
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "oneshot-privacy"))
        pick = torch.randperm(len(kept), generator=g)[:o.privacy_samples].sort().values
        # only the devices behind the measured subset are loaded (every rank computes the same numbers)
        raw = {cid: self.device_pixels(cid)[0] for cid in torch.unique(enc.owner[kept[pick]]).tolist()}
        sources = []
        for i in kept[pick].tolist():
            rows = enc.source_index[i]
            sources.append(raw[int(enc.owner[i])][rows[rows >= 0]])
        samples = augmented[pick]
        mds = mds_min_distances(samples, sources, dims=o.mds_dims)
        pix = pixel_min_distances(samples, sources)
        self.metrics.update(privacy_mds_mean=mds.mean, privacy_mds_std=mds.std,
                            privacy_pixel_mean=pix.mean, privacy_pixel_std=pix.std,
                            privacy_samples=float(mds.count))
