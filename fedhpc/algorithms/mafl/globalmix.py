"""GlobalMix (FedMix paper, Fig. 1a / Eq. 2): mixup with OTHER clients' raw samples.

The privacy-violating upper reference of the paper: every client shares its raw
training samples, and a training client mixes each local sample with a random
raw sample of another client:

    x~ = (1-l) x_i + l x_j,   loss = (1-l) L(f(x~), y_i) + l L(f(x~), y_j)

It is NOT a federated algorithm in any privacy sense; it exists to bound what
FedMix approximates. A warning says so at start-up, and the raw samples are
counted in the ledger as kind "raw_samples": up once (every client's shared
samples, stored dtype: uint8 pixels stay 1 byte), down once per client, the first
round it is sampled (the other clients' samples it receives and keeps, as MAFL's
clients keep the means: :class:`fedhpc.exchanges.mean_data.MeanDataExchange`);
which clients hold the pool is checkpointed.

Exchange: before round 1, rank ``cid % world_size`` puts client cid's samples
(all of them, or a seeded random ``raw_per_client`` of them) into one all_gather
of inputs and one of (client id, index, label); every rank sorts the pool by
(client id, index). Mixing partners are drawn per sample (default; mixup's
usual form) or one per batch, seeded by (seed, round, client); partners pass
through ``data.transform(x, False, None)`` (no augmentation). Fixed l by default,
``--mix-alpha`` draws l ~ Beta(alpha, alpha) per batch. Text mixes embeddings.

Which l: the paper gives none for Global Mixup (Table 8 lists l for NaiveMix and
FedMix only). The default fixed l = 0.1 is Table 5's fixed-l reference (CIFAR-10:
global mixup 79.4 / 80.4 / 81.1 / 63.6 at l = 0.05 / 0.1 / 0.2 / 0.5). Table 1's
Global Mixup row (CIFAR-10 88.2) is above every fixed-l value of Table 5, so it is
not a fixed-l run: mixup's l is "chosen from the beta distribution for each
training step" (Sec. 3.1), with an alpha the paper does not report. For that row
use ``--mix-alpha A`` and state the A chosen.

Batched clients (``--clients-at-once K``, :mod:`fedhpc.batched`): ``batched_loss`` is ``loss`` for K
clients, each drawing its lambda and its partners from its own streams as ``loss`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...batched import add_proximal_terms
from ...data.base import host_to_device
from ...errors import ConfigError
from ...exchanges.mean_data import KeptCopies
from ...exchanges.ownership import canonical_order, owner_rank
from ...exchanges.traffic_audit import auditing, record_sent
from .. import register_algorithm
from ..base import Algorithm, derive_seed
from ..fedprox import add_proximal_term
from .localmix import draw_lambda
from .mixing import MixSpace, batched_mixup_loss, mixup_loss


class PrivacyViolationWarning(UserWarning):
    pass


@dataclass
class GlobalMixOptions:
    lam: float = field(default=0.1, metadata={"help": "fixed mixing ratio lambda (used when --mix-alpha is 0)"})
    mix_alpha: float = field(default=0.0, metadata={"help": "draw lambda ~ Beta(alpha, alpha) per batch (0 = fixed)"})
    select: str = field(default="sample", metadata={"help": "one raw partner per sample (mixup) or per batch"})
    raw_per_client: int = field(default=0, metadata={"help": "raw samples each client shares (0 = all)"})
    prox_mu: float = field(default=0.0, metadata={"help": "FedProx coefficient mu (0 = off)"})

    def validate(self):
        if not 0 <= self.lam <= 1:
            raise ConfigError(f"--lam must be in [0, 1], got {self.lam}")
        if not self.mix_alpha >= 0:
            raise ConfigError(f"--mix-alpha must be >= 0, got {self.mix_alpha}")
        if self.select not in ("batch", "sample"):
            raise ConfigError(f"--select must be batch or sample, got {self.select!r}")
        if self.raw_per_client < 0:
            raise ConfigError(f"--raw-per-client must be >= 0 (0 = all), got {self.raw_per_client}")
        if not self.prox_mu >= 0:
            raise ConfigError(f"--prox-mu must be >= 0 (0 = off), got {self.prox_mu}")


@register_algorithm("globalmix")
class GlobalMix(Algorithm):
    """Mixup with other clients' RAW samples: violates privacy (the paper's upper reference)."""

    Options = GlobalMixOptions
    ledger_kinds = ("parameters", "raw_samples")
    #: plain SGD steps on ``loss``; batched_loss is the same loss for K clients (fedhpc.batched)
    batchable = True

    def setup(self):
        self.options = self.options or GlobalMixOptions()
        self.space = MixSpace(self.data.task, self.data.num_classes)
        self.space.check(self.model, self.model_named)
        self.pool = None
        self.kept = KeptCopies(self.data.num_clients)  # who received the pool (the download ledger)
        self.warn("GlobalMix VIOLATES PRIVACY: every client shares its raw training samples with "
                  "the other clients. It is a reference upper bound, not a federated algorithm.",
                  PrivacyViolationWarning)

    # ---------------------------------------------------------------- the raw-sample exchange
    def _gather_pool(self) -> int:
        data, comm, o = self.data, self.comm, self.options
        xs, metas = [], []
        for cid in self.hosted_training_clients():  # a cold-start client shares nothing
            assert owner_rank(cid, comm.size) == comm.rank
            c = data.client(cid)
            idx = torch.arange(c.num_train)
            if o.raw_per_client and o.raw_per_client < c.num_train:
                g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "raw_share", cid))
                idx = torch.randperm(c.num_train, generator=g)[: o.raw_per_client].sort().values
            x = c.x[idx].reshape(len(idx), -1)
            meta = torch.cat([torch.full((len(idx), 1), cid), idx[:, None], c.y[idx].reshape(len(idx), -1).long()], 1)
            for r in range(len(idx) if auditing() else 0):
                record_sent(cid, "raw_samples", x[r], x[r], [int(idx[r])])
                record_sent(cid, "raw_samples", meta[r], x[r], [int(idx[r])])
            xs.append(x)
            metas.append(meta)
        dx = int(torch.tensor(data.input_shape).prod()) if data.input_shape else 1
        ydim = 1 if data.task != "next_char" else int(data.input_shape[0])
        dtype = xs[0].dtype if xs else self._stored_dtype()
        x_local = torch.cat(xs) if xs else torch.zeros(1, dx, dtype=dtype)
        m_local = torch.cat(metas) if metas else torch.full((1, 2 + ydim), -1, dtype=torch.long)
        dev = self.device
        x_all = torch.cat(comm.all_gather(x_local.to(dev)))
        m_all = torch.cat(comm.all_gather(m_local.to(dev)))
        keep = m_all[:, 0] >= 0
        x_all, m_all = x_all[keep], m_all[keep]
        order = canonical_order(m_all[:, 0], m_all[:, 1])
        self.pool = {
            "x": x_all[order].reshape((-1,) + tuple(data.input_shape)),
            "owner": m_all[order, 0],
            "y": m_all[order, 2:].reshape((-1,) + ((ydim,) if data.task == "next_char" else ())),
        }
        return self._pool_bytes(torch.ones(len(order), dtype=torch.bool, device=dev))

    def _stored_dtype(self):
        return self.data.client(0).x.dtype

    def _pool_bytes(self, mask) -> int:
        n = int(mask.sum())
        px, py = self.pool["x"], self.pool["y"]
        return n * (px[0].numel() * px.element_size() + py[0].numel() * py.element_size()) if len(px) else 0

    def round_begin(self, rnd):
        up = 0
        if self.pool is None:  # collective, once
            up = self._gather_pool()
            if rnd.index > 0:
                up = 0  # a resumed run rebuilds what was shared before round 1: nothing is re-sent
        if up and self.comm.rank == 0:  # summed over ranks: book the shared pool once
            self.ledger.add("up", "raw_samples", up)
        self.kept.round_begin(0, rnd.sampled)  # one pool for the whole run: version 0

    def download(self, ctx):
        super().download(ctx)
        mask = self.pool["owner"] != ctx.cid
        if self.kept.receives(ctx.cid):  # later rounds it mixes with the copy it kept
            ctx.ledger.add("down", "raw_samples", self._pool_bytes(mask))
        ctx.extra["partners"] = mask.nonzero().flatten()
        ctx.extra["select_gen"] = ctx.generator("raw_select")

    def state_dict(self):
        return self.kept.state_dict()

    def load_state_dict(self, state):
        self.kept.load_state_dict(state)

    # ---------------------------------------------------------------- local objective
    def loss(self, model, x, y, ctx):
        partners = ctx.extra["partners"]
        lam = draw_lambda(ctx, self.options)
        xin = self.space.lift(model, x)
        ydtype = xin.dtype if xin.is_floating_point() else torch.float32
        yin = self.space.labels(y, ydtype)
        if len(partners) == 0:
            loss = mixup_loss(self.space.f(model), xin, yin, xin, yin, 0.0)
        else:
            n = x.shape[0] if self.options.select == "sample" else 1
            pick = partners[torch.randint(len(partners), (n,), generator=ctx.extra["select_gen"]).to(partners.device)]
            # the pool holds inputs as stored (uint8 pixels, uint8 character ids): the dataset's
            # evaluation transform makes them what the local batch is (for text, int64 ids to embed)
            xj = self.data.transform(self.pool["x"][pick], False, None)
            xj = self.space.lift(model, xj if self.space.text else xj.to(xin.dtype))
            yj = self.space.labels(self.pool["y"][pick], ydtype)
            loss = mixup_loss(self.space.f(model), xin, yin, xj, yj, lam)
        return add_proximal_term(loss, self, model, self.options.prox_mu, ctx)

    def batched_loss(self, group, x, y, weight):
        """``loss`` for K clients (fedhpc.batched). Each active client draws its lambda and its
        partners (one per real row, or one for the batch) from its own streams, in the order ``loss``
        draws them; a padded row mixes with the client's first partner (weight 0: it adds nothing).
        A client with no partner (the only one holding data) mixes its rows with themselves, which is
        the plain cross-entropy ``loss`` takes then, within float rounding."""
        k, b = x.shape[0], x.shape[1]
        rows = b if self.options.select == "sample" else 1
        # the pool rows every client mixes with, drawn on the host and sent in one copy a step (a copy
        # per client would each wait on the GPU's queue)
        pick = torch.zeros(k, rows, dtype=torch.long)
        lam = torch.zeros(k, dtype=torch.float64)
        alone = torch.zeros(k, dtype=torch.bool)  # no partner drawn: mixes with its own rows
        for i, ctx in enumerate(group.ctxs):
            if not group.active[i]:
                alone[i] = True
                continue
            if "partners_host" not in ctx.extra:  # once a round: its partners' pool rows, on the host
                ctx.extra["partners_host"] = ctx.extra["partners"].cpu()
            partners = ctx.extra["partners_host"]
            lam[i] = draw_lambda(ctx, self.options)
            if len(partners) == 0:
                alone[i] = True
                continue
            n = group.real[i] if rows > 1 else 1
            drawn = partners[torch.randint(len(partners), (n,), generator=ctx.extra["select_gen"])]
            pick[i, :n] = drawn
            pick[i, n:] = drawn[0]
        flat = host_to_device(pick.reshape(-1), self.pool["x"].device)
        xj = self.data.transform(self.pool["x"][flat], False, None).to(x.dtype).reshape((k, rows) + x.shape[2:])
        yin = self.space.labels(y, x.dtype)
        yj = self.space.labels(self.pool["y"][flat], x.dtype).reshape(k, rows, -1)
        if bool(alone.any()):
            mask = host_to_device(alone, x.device)
            xj = torch.where(mask.view((k,) + (1,) * (x.dim() - 1)), x, xj.expand_as(x))
            yj = torch.where(mask.view(k, 1, 1), yin, yj.expand_as(yin))
        # a fixed lambda stays a float, as loss uses it
        lam = self.options.lam if self.options.mix_alpha <= 0 else host_to_device(lam, x.device)
        loss = batched_mixup_loss(group.forward, x, yin, xj, yj, lam, weight)
        return add_proximal_terms(loss, group, self, self.options.prox_mu)  # per-client anchors
