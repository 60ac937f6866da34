"""The run's settings: :class:`RunConfig`, its validation and the identity a checkpoint must share."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from ..errors import ConfigError


def parse_rounds(spec: str, total_rounds: Optional[int] = None) -> List[int]:
    """Rounds (1-based, as ``metrics.jsonl`` counts them) named by ``"last"``, ``"5,25"`` or ``""``."""
    out: List[int] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part == "last":
            if total_rounds is not None:
                out.append(int(total_rounds))
            continue
        try:
            r = int(part)
        except ValueError:
            raise ConfigError(f"--save-client-models takes 'last' or round numbers like '5,25'; got {spec!r}")
        if r < 1:
            raise ConfigError(f"--save-client-models rounds count from 1; got {r}")
        out.append(r)
    return sorted(set(out))


@dataclass
class RunConfig:
    algo: str = field(default="fedavg", metadata={"help": "federated algorithm (see list below)"})
    dataset: str = field(default="digits", metadata={"help": "dataset (see list below)"})
    data_dir: str = field(default="", metadata={"help": "folder holding the real datasets in their published formats"})
    model: str = field(default="auto", metadata={"help": "model name; 'auto' takes the dataset's default, or the dataset's residual network for the methods that need one (the FedAlign family: resnet_digits on digits, resnet_mnist on mnist5k); the run's first lines say which"})
    partition: str = field(default="auto", metadata={"help": "auto (natural for naturally federated data, else iid) | iid | dirichlet:ALPHA | dirichlet_capped:ALPHA[:MIN] | classes:K (random draw) | classes_cyclic:K | skewed:M:A:B | natural | mix2fld"})
    num_clients: int = field(default=20, metadata={"help": "number of simulated clients N"})
    clients_per_round: int = field(default=10, metadata={"help": "clients sampled per round K (1 <= K <= N)"})
    rounds: int = field(default=20, metadata={"help": "communication rounds"})
    local_epochs: int = field(default=1, metadata={"help": "local epochs E per round"})
    batch_size: int = field(default=10, metadata={"help": "local mini-batch size"})
    lr: float = field(default=0.05, metadata={"help": "client learning rate"})
    lr_decay: float = field(default=1.0, metadata={"help": "client lr multiplied by this every round (FedMix: 0.999)"})
    optimizer: str = field(default="sgd", metadata={"help": "local optimizer: sgd | adam"})
    momentum: float = field(default=0.0, metadata={"help": "SGD momentum (reset every round, as clients are stateless)"})
    nesterov: bool = field(default=False, metadata={"help": "Nesterov momentum for the local SGD (the FedAlign authors' code); needs --momentum > 0"})
    weight_decay: float = field(default=0.0, metadata={"help": "local weight decay"})
    grad_clip: float = field(default=0.0, metadata={"help": "clip local gradient norm to this (0 = off)"})
    clients_at_once: int = field(default=1, metadata={"help": "train this many of a rank's clients at once as one batched model (fedhpc/batched/: the methods starred in the list of algorithms below; SGD or Adam; dropout and BatchNorm in models whose layers with weights are Linear, Conv2d or BatchNorm); 1 = one after another"})
    client_test_fraction: float = field(default=0.2, metadata={"help": "share of each client's data kept as its local test split"})
    seed: int = field(default=0, metadata={"help": "fixes client sampling, partitions, initialisation and batch order"})
    out: str = field(default="", metadata={"help": "output folder (metrics.jsonl, final_model.pt, checkpoints, TensorBoard)"})
    resume: bool = field(default=False, metadata={"help": "continue from the latest checkpoint in --out"})
    eval_every: int = field(default=1, metadata={"help": "evaluate the global model every N rounds (and after the last)"})
    checkpoint_every: int = field(default=10, metadata={"help": "checkpoint every N rounds (0 = only on SIGTERM/SIGUSR1)"})
    eval_batch_size: int = field(default=1000, metadata={"help": "batch size for evaluation"})
    threads: int = field(default=0, metadata={"help": "torch threads per rank (0 = cores on this node / ranks on this node)"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda (one GPU per local rank)"})
    deterministic: bool = field(default=True, metadata={"help": "on GPUs: deterministic cuDNN / cuBLAS kernels and no TF32, so a seed gives the same model whatever the ranks, batching or run (--no-deterministic: TF32 and the fastest kernels, results vary in the 4th digit)"})
    collective_backend: str = field(default="auto", metadata={"help": "auto | nccl | gloo: auto takes NCCL when every rank of a node has its own GPU, gloo (through host memory) on CPU and when ranks share a GPU"})
    client_state_budget_mb: float = field(default=1024.0, metadata={"help": "memory for per-client state per rank before spilling to disk (inf: never spill)"})
    collective_timeout: float = field(default=600.0, metadata={"help": "seconds a collective waits for peers before declaring a rank dead"})
    tensorboard: bool = field(default=True, metadata={"help": "write TensorBoard event files (rank 0) under --out"})
    quiet: bool = field(default=False, metadata={"help": "no per-round progress lines"})
    cold_start_fraction: float = field(default=0.0, metadata={"help": "share of clients held out of training entirely and evaluated at the end after the method's adaptation (pMixFed Sec. 10.2; 0 = off)"})
    final_adapt: bool = field(default=False, metadata={"help": "at the final evaluation, every trained client also adapts the final global model with the method's cold-start adaptation and is evaluated on its own split: local_test_accuracy_adapted* (pMixFed App. 10.1's protocol; needs --client-test-fraction > 0)"})
    local_eval: bool = field(default=True, metadata={"help": "every eval round, evaluate the model each client would use on its own local test split (local_test_accuracy)"})
    local_eval_clients: int = field(default=0, metadata={"help": "evaluate the clients' own models on a seeded sample of this many training clients at every eval round but the last, which covers all of them (0 = all clients every time; Flower's fraction_evaluate): at thousands of clients, and for methods that adapt each client at evaluation, the local evaluation can cost more than the rounds"})
    channel: str = field(default="none", metadata={"help": "wireless channel model (Mix2FLD Sec. II-C): none | symmetric | asymmetric; parameters with --channel-opt k=v"})
    save_client_models: str = field(default="", metadata={"help": "save every trained client model at these rounds ('last', '5,25'; empty = none) under OUT/client_models/ for python -m fedhpc.analysis.hessian"})
    per_label_accuracy: bool = field(default=False, metadata={"help": "also report each label's accuracy on the global test set (test_accuracy_label<c>; XorMixFL's target labels)"})
    stop_epsilon: float = field(default=0.0, metadata={"help": "stop when the global state's relative change falls below this (Mix2FLD; 0 = off): for FD methods (fd, fld, mixfld, mix2fld) the largest over labels n of |G_out,n^p - G_out,n^p-1| / |G_out,n^p-1| (the paper's 'for all n'), otherwise |G_p - G_p-1| / |G_p-1| over the model's parameters"})
    algo_options: Dict[str, Any] = field(default_factory=dict)
    data_options: Dict[str, Any] = field(default_factory=dict)
    model_options: Dict[str, Any] = field(default_factory=dict)
    channel_options: Dict[str, Any] = field(default_factory=dict)
    #: what a paper reports for this setting (paper, table, row, metric, value): read by fedhpc.report
    reference: Dict[str, Any] = field(default_factory=dict)

    # The --channel values (fedhpc/server/channel.py's Channel.MODES): "none" simulates no links.
    CHANNELS = ("none", "symmetric", "asymmetric")

    #: what the launcher resolved for this run beyond what its file and flags say, one phrase each
    #: (fedhpc.config.auto: the dataset's lr, a method's model, server set or server steps); not a
    #: setting: the values themselves are in the fields, and the engine says these at the start
    auto_resolved: ClassVar[Tuple[str, ...]] = ()

    # Fields that define *what* is computed: a checkpoint may only be resumed under the
    # same values. The others (rounds, cadence, threads, device, out...) may change.
    IDENTITY = (
        "algo", "dataset", "model", "partition", "num_clients", "clients_per_round",
        "local_epochs", "batch_size", "lr", "lr_decay", "optimizer", "momentum",
        "weight_decay", "grad_clip", "client_test_fraction", "seed", "algo_options",
        "data_options", "model_options", "channel", "channel_options", "stop_epsilon", "cold_start_fraction",
    )

    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(msg)

        need(self.num_clients >= 1, f"--num-clients must be at least 1, got {self.num_clients}")
        need(
            1 <= self.clients_per_round <= self.num_clients,
            f"--clients-per-round must be between 1 and --num-clients ({self.num_clients}), "
            f"got {self.clients_per_round}",
        )
        need(self.rounds >= 1, f"--rounds must be positive, got {self.rounds}")
        need(self.local_epochs >= 1, f"--local-epochs must be positive, got {self.local_epochs}")
        need(self.batch_size >= 1, f"--batch-size must be positive, got {self.batch_size}")
        need(math.isfinite(self.lr) and self.lr > 0, f"--lr must be a positive number, got {self.lr}")
        need(0 < self.lr_decay <= 1, f"--lr-decay must be in (0, 1], got {self.lr_decay}")
        need(self.optimizer in ("sgd", "adam"), f"--optimizer must be sgd or adam, got {self.optimizer!r}")
        need(0 <= self.momentum < 1, f"--momentum must be in [0, 1), got {self.momentum}")
        need(not self.nesterov or (self.optimizer == "sgd" and self.momentum > 0),
             f"--nesterov needs --optimizer sgd and --momentum > 0 (got {self.optimizer}, momentum {self.momentum})")
        # torch's Adam takes no momentum (its betas play that part and are not settable here): the
        # value would be silently ignored, and a run labelled with it would not be what it says.
        need(self.optimizer != "adam" or self.momentum == 0,
             f"--momentum {self.momentum} has no effect with --optimizer adam (Adam's own moment estimates, its "
             f"betas, are not settable here); use --optimizer sgd for SGD with momentum, or leave --momentum at 0")
        need(self.weight_decay >= 0, f"--weight-decay must be non-negative, got {self.weight_decay}")
        need(self.grad_clip >= 0, f"--grad-clip must be non-negative (0 = off), got {self.grad_clip}")
        need(self.clients_at_once >= 1, f"--clients-at-once must be at least 1 (1 = one client after another), got {self.clients_at_once}")
        need(0 <= self.client_test_fraction < 1, f"--client-test-fraction must be in [0, 1), got {self.client_test_fraction}")
        need(self.eval_every >= 1, f"--eval-every must be positive, got {self.eval_every}")
        need(self.local_eval_clients >= 0, f"--local-eval-clients must be >= 0 (0 = every client), got {self.local_eval_clients}")
        need(self.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 (0 = only on signals), got {self.checkpoint_every}")
        need(self.eval_batch_size >= 1, f"--eval-batch-size must be positive, got {self.eval_batch_size}")
        need(self.threads >= 0, f"--threads must be >= 0 (0 = automatic), got {self.threads}")
        need(self.device in ("auto", "cpu", "cuda"), f"--device must be auto, cpu or cuda, got {self.device!r}")
        need(self.collective_backend in ("auto", "nccl", "gloo"),
             f"--collective-backend must be auto, nccl or gloo, got {self.collective_backend!r}")
        need(self.collective_backend != "nccl" or self.device != "cpu",
             "--collective-backend nccl needs --device cuda (or auto on a GPU node); CPU runs use gloo")
        need(self.client_state_budget_mb > 0, "--client-state-budget-mb must be positive")
        need(self.collective_timeout > 0, "--collective-timeout must be positive")
        need(self.seed >= 0, f"--seed must be non-negative, got {self.seed}")
        # a round past --rounds is never reached, so its models would silently never be written
        beyond = [r for r in parse_rounds(self.save_client_models, self.rounds) if r > self.rounds]
        need(not beyond,
             f"--save-client-models names round(s) {', '.join(map(str, beyond))} but --rounds is {self.rounds}, "
             f"so they would never be saved; use rounds <= {self.rounds} or 'last' (or raise --rounds)")
        need(not self.save_client_models or bool(self.out),
             "--save-client-models needs --out DIR (the client models go to DIR/client_models)")
        need(not self.resume or bool(self.out), "--resume needs --out DIR (the folder holding the checkpoints)")
        need(self.channel in self.CHANNELS,
             f"--channel must be {', '.join(self.CHANNELS[:-1])} or {self.CHANNELS[-1]}, got {self.channel!r}")
        # with no channel model nothing reads them: a run would silently be the channel-free one
        models = [c for c in self.CHANNELS if c != "none"]
        need(self.channel != "none" or not self.channel_options,
             f"channel option(s) {', '.join(map(str, self.channel_options))} are set but --channel is none, which "
             f"simulates no links, so they would be ignored; they need a channel model: "
             f"--channel {' or '.join(models)} (or remove the options)")
        need(not self.final_adapt or self.client_test_fraction > 0,
             "--final-adapt evaluates every trained client on its own test split, but --client-test-fraction is 0; "
             "set it > 0 (e.g. 0.2) or leave --final-adapt off")
        need(0 <= self.cold_start_fraction < 1,
             f"--cold-start-fraction must be in [0, 1), got {self.cold_start_fraction}")
        need(math.isfinite(self.stop_epsilon) and self.stop_epsilon >= 0,
             f"--stop-epsilon must be >= 0 (0 = off), got {self.stop_epsilon}")
        # clients are saved while they train, before the round's aggregation can tell whether it ends the run
        need(self.stop_epsilon == 0 or "last" not in [p.strip() for p in self.save_client_models.split(",")],
             "--save-client-models last cannot be combined with --stop-epsilon: the last round is only known "
             "after its clients trained; name the rounds to keep (e.g. --save-client-models 5,10,15)")

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def identity(self, algorithm_settings: Sequence[str] = ()) -> Dict[str, Any]:
        """What a checkpoint of this run must agree on; ``algorithm_settings``: the other settings
        the run's algorithm reads in its updates (``Algorithm.identity_settings``: pMixFed's rounds)."""
        from ..data.partition import PARTITION_RULES

        ident = {k: getattr(self, k) for k in (*self.IDENTITY, *algorithm_settings)}
        ident["partition_rules"] = PARTITION_RULES  # the same spec string may have meant another split
        if self.nesterov:  # only when set, so checkpoints written before the option still resume
            ident["nesterov"] = True
        return json.loads(json.dumps(ident, default=str))


def setting_default(name: str) -> Any:
    """RunConfig's default for the setting ``name`` (what the launcher uses when a run omits it);
    None for a name that is no RunConfig field."""
    for f in fields(RunConfig):
        if f.name == name:
            return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
    return None
