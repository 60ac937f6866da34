"""Typed run configuration, settable from YAML files and command-line flags.

Precedence: dataclass defaults < ``--config FILE.yaml`` < command-line flags.
The algorithm's own options (``Algorithm.Options``) are flags too (``--mu 0.01``)
and live under ``algo_options:`` in YAML; dataset and model options live under
``data_options:`` / ``model_options:`` (``--data-opt k=v``, ``--model-opt k=v``).
Everything is validated before any output is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, get_type_hints

import yaml

from .errors import ConfigError


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
    model: str = field(default="auto", metadata={"help": "model name; 'auto' takes the dataset's default"})
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
    clients_at_once: int = field(default=1, metadata={"help": "train this many of a rank's clients at once as one batched model (fedhpc/batched.py: fedavg, fedprox, naivemix, fedmix, localmix; SGD; models without dropout or BatchNorm); 1 = one after another"})
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
        from .data.partition import PARTITION_RULES

        ident = {k: getattr(self, k) for k in (*self.IDENTITY, *algorithm_settings)}
        ident["partition_rules"] = PARTITION_RULES  # the same spec string may have meant another split
        if self.nesterov:  # only when set, so checkpoints written before the option still resume
            ident["nesterov"] = True
        return json.loads(json.dumps(ident, default=str))


# --------------------------------------------------------------------------- options

def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Convert a YAML/CLI value to a dataclass field's type, with a clear error."""
    if value is None and typ in (bool, int, float, str):
        # YAML reads `out:` with nothing after it as null; str(None) would be a folder named 'None'
        raise ConfigError(f"{where} has no value (YAML reads an empty `key:` line as null); give it one, or "
                          f"remove the line to use the default")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if typ in (int, float, str):
        if typ is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if typ is not str and isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            return typ(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be of type {typ.__name__}, got {value!r}")
    return value


def build_options(cls: Optional[Type], values: Dict[str, Any], what: str) -> Any:
    """Instantiate an options dataclass from a dict, rejecting unknown keys."""
    if cls is None:
        if values:
            raise ConfigError(f"{what} takes no options, got {sorted(values)}")
        return None
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - names, key=str)
    if unknown:
        near = difflib.get_close_matches(str(unknown[0]), names, n=1) if len(unknown) == 1 else []
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{what} has no option(s) {unknown}{hint}; valid: {sorted(names)}")
    opts = cls(**{k: _coerce(v, hints[k], f"{what} option {k!r}") for k, v in values.items()})
    if hasattr(opts, "validate"):
        opts.validate()
    return opts


# --------------------------------------------------------------------------- command line

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_dataclass_flags(group, cls: Type, skip=()) -> List[str]:
    hints = get_type_hints(cls)
    added = []
    for f in fields(cls):
        if f.name in skip or f.name.isupper():
            continue
        typ = hints[f.name]
        if typ not in (int, float, str, bool):
            continue
        helptext = f.metadata.get("help", "") if f.metadata else ""
        default = f.default if f.default is not dataclasses.MISSING else None
        if typ is bool:
            group.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=f"{helptext} (default: {default})")
        else:
            group.add_argument(_flag(f.name), dest=f.name, type=typ, default=argparse.SUPPRESS,
                               metavar=typ.__name__.upper(), help=f"{helptext} (default: {default})")
        added.append(f.name)
    return added


def _parse_kv(items: List[str], what: str) -> Dict[str, Any]:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"{what} expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = yaml.load(v, Loader=UniqueKeyLoader)
        except DuplicateKeyError as e:
            raise ConfigError(f"{what} {item!r}: the value sets {e.key!r} twice; keep one")
        except yaml.YAMLError as e:
            problem = str(getattr(e, "problem", None) or e).splitlines()[0]
            raise ConfigError(f"{what} {item!r}: the value {v!r} is not valid YAML ({problem}); write a number, "
                              f"true/false, a list such as [4, 8], or a string in quotes: {k.strip()}=\"{v}\"")
    return out


def _catalogue() -> str:
    from .algorithms import ALGORITHMS, load_algorithm_modules
    from .data import DATASETS, load_dataset_modules
    from .data.partition import partition_help
    from .models import MODELS, load_model_modules

    load_algorithm_modules(); load_dataset_modules(); load_model_modules()
    lines = ["algorithms:"]
    for n in ALGORITHMS.names():
        doc = (ALGORITHMS.get(n).__doc__ or "").strip().splitlines()
        lines.append(f"  {n:14s} {doc[0] if doc else ''}")
    for alias, name in sorted(ALGORITHMS.aliases().items()):
        lines.append(f"  {alias:14s} = {name}")
    lines.append("datasets:")
    for n in DATASETS.names():
        lines.append(f"  {n:14s} {DATASETS.get(n).help}")
    lines.append("models: " + ", ".join(MODELS.names()))
    lines.append("partitions: " + partition_help())
    lines.append("Algorithm options are flags once --algo is given (try --algo fedprox --help).")
    return "\n".join(lines)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that names one key twice (see :class:`UniqueKeyLoader`)."""

    def __init__(self, key: Any, first_line: int, line: int):
        super().__init__(f"key {key!r} appears twice (lines {first_line} and {line})")
        self.key, self.first_line, self.line = key, first_line, line


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping: PyYAML silently keeps the
    last one, so a setting edited further up a long file would be ignored without a word."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: Dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden key by key
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKeyError(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    continue
        return super().construct_mapping(node, deep)


def load_yaml(path: str, what: str = "config file") -> Dict[str, Any]:
    """A user's YAML file (launch config, sweep grid) as a mapping; every problem is a ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path!r} does not exist; pass an existing YAML file "
                          f"(examples in launch/ and sweeps/)")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}); save it as UTF-8 (editors that write UTF-16 or Latin-1 do this)")
    except OSError as e:
        raise ConfigError(f"{what} {path!r} cannot be read ({e.strerror}); check its permissions")
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader) or {}
    except DuplicateKeyError as e:
        raise ConfigError(f"{what} {path!r} sets {e.key!r} twice (lines {e.first_line} and {e.line}); "
                          f"YAML would silently keep the last, so delete the one you do not mean")
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path!r} is not valid YAML: {e}")
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path!r} must hold a mapping of settings, got {type(data).__name__}")
    return data


def option_names(cls: Optional[Type]) -> set:
    """The option names of an options dataclass (none for a method or dataset without options)."""
    return {f.name for f in fields(cls)} if cls is not None else set()


def _unknown_settings(path: str, unknown: List[Any], file_values: Dict[str, Any], algo_name: Any,
                      data_name: Any, model_name: Any) -> str:
    """The message for top-level keys that are not settings: where an option belongs, or the near key."""
    from .algorithms import ALGORITHMS
    from .data import DATASETS
    from .models import MODELS, load_model_modules, model_option_params

    load_model_modules()
    valid = sorted(f.name for f in fields(RunConfig))

    # The option mappings this file's algorithm, dataset and model read, where a stray key may belong.
    homes = []
    if algo_name in ALGORITHMS:
        homes.append(("algo_options", f"algorithm {ALGORITHMS.canonical(algo_name)!r}",
                      option_names(ALGORITHMS.get(algo_name).Options)))
    if data_name in DATASETS:
        homes.append(("data_options", f"dataset {DATASETS.canonical(data_name)!r}",
                      option_names(DATASETS.get(data_name).options)))
    if model_name in MODELS:
        homes.append(("model_options", f"model {MODELS.canonical(model_name)!r}",
                      set(model_option_params(model_name))))
    notes, list_valid = [], False
    for k in unknown:
        home = next(((m, who) for m, who, names in homes if k in names), None)
        if home is not None:
            example = yaml.safe_dump({home[0]: {k: file_values[k]}}, default_flow_style=None).strip()
            notes.append(f"{k!r} is an option of {home[1]}: put it under {home[0]} (`{example}`)")
            continue
        others = [n for n in ALGORITHMS.names() if k in option_names(ALGORITHMS.get(n).Options)]
        if others:
            notes.append(f"{k!r} is an option of algorithm(s) {', '.join(others)}, not of the algorithm this "
                         f"file runs: set algo: to one of them and put {k!r} under algo_options:")
            continue
        near = difflib.get_close_matches(str(k), valid, n=1)
        near_option = [(m, n) for m, _, names in homes for n in difflib.get_close_matches(str(k), names, n=1)]
        if near:
            notes.append(f"{k!r} is not a setting (did you mean {near[0]!r}?)")
        elif near_option:
            notes.append(f"{k!r} is not a setting (did you mean {near_option[0][1]!r}, under {near_option[0][0]}?)")
        else:
            notes.append(f"{k!r} is not a setting")
            list_valid = True
    tail = f"; valid: {valid}" if list_valid else ""
    return f"config file {path!r} has unknown setting(s) {unknown}: " + "; ".join(notes) + tail


def launcher_rank() -> int:
    """This process's rank as the launcher's environment says, before any World exists."""
    for key in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


#: Field metadata key of an algorithm option whose meaning is its method's own while other methods
#: have an option of the same name (FedAvg's server_lr steps the averaged update; FLD's and the
#: server trainers' is a learning rate): such an option is not carried over to or from another
#: algorithm by ``--algo`` unless both read the very same field (one Options class, or inherited).
METHOD_SPECIFIC = "method_specific"


def _same_meaning(old_cls, new_cls, name: str) -> bool:
    """Whether option ``name`` of both Options classes may take one value: the same field, or
    neither marked :data:`METHOD_SPECIFIC`."""
    old = next((f for f in fields(old_cls) if f.name == name), None) if old_cls is not None else None
    new = next(f for f in fields(new_cls) if f.name == name)
    if old is None or old is new:  # not an option of the file's algorithm (kept as written), or one definition
        return True
    return not (old.metadata.get(METHOD_SPECIFIC) or new.metadata.get(METHOD_SPECIFIC))


#: The option mappings of RunConfig and the setting naming what each belongs to.
OPTION_OWNERS = {"algo_options": "algo", "data_options": "dataset", "model_options": "model"}


def setting_default(name: str) -> Any:
    """RunConfig's default for the setting ``name`` (what the launcher uses when a run omits it);
    None for a name that is no RunConfig field."""
    for f in fields(RunConfig):
        if f.name == name:
            return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
    return None


def algorithm_identity_settings(algo: Any) -> Tuple[str, ...]:
    """``identity_settings`` of the algorithm named ``algo`` (the settings its updates read beyond
    RunConfig.IDENTITY: pMixFed's schedule reads ``rounds``); () for a name the registry does not
    know (the launcher refuses it, naming it)."""
    from .algorithms import ALGORITHMS, load_algorithm_modules

    load_algorithm_modules()
    try:
        return tuple(ALGORITHMS.get(ALGORITHMS.canonical(algo)).identity_settings)
    except (ConfigError, TypeError):
        return ()


def identity_changes(layer: Dict[str, Any], final: Dict[str, Any]) -> List[str]:
    """The identity settings (:attr:`RunConfig.IDENTITY` but ``seed``, then the algorithm's
    ``identity_settings``) to which ``final`` gives another meaning than ``layer``, in that order:
    a paper's ``reference`` written in a layer of settings (a config file; a sweep's config file
    and base) describes that layer's setting, so a run whose later layer (command-line flags; a
    sweep point's axes) changes one of these is not the reference's run. ``seed`` is no change of
    setting (a paper's row averages over seeds), nor is anything else outside IDENTITY (cadence,
    threads, out, data_dir), nor ``rounds`` unless the algorithm's updates read it (pMixFed's
    schedule: its identity_settings, which a checkpoint's identity holds too; FedAvg's rounds only
    say how long the same setting runs).

    Both are settings mappings as a YAML file writes them; a key that is not set is RunConfig's
    default. Values are read as the launcher reads them (a scalar converted to its field's type,
    ``model: Auto`` is ``auto``, an empty option mapping is ``{}``) and then as a resume compares
    them (:func:`fedhpc.checkpoint.canonical_identity`: registry names and aliases, option mappings
    with their defaults, a partition's spelling), so a spelling is no change. An option mapping is
    not named when what it belongs to (its algorithm, dataset, model) is: its options are another's.
    A value the launcher would refuse is compared as written (validation names it)."""
    from .checkpoint import canonical_identity

    hints = get_type_hints(RunConfig)
    defaults = RunConfig()
    # the settings of either side's algorithm: when the algorithm itself changes, that is named alone
    extra = [k for algo in (layer.get("algo", defaults.algo), final.get("algo", defaults.algo))
             for k in algorithm_identity_settings(algo) if k not in RunConfig.IDENTITY]
    names = [*RunConfig.IDENTITY, *dict.fromkeys(extra)]

    def read(values: Dict[str, Any]) -> Dict[str, Any]:
        out = {}
        for k in names:
            v = values.get(k, getattr(defaults, k))
            if hints[k] in (int, float, str, bool):
                try:
                    v = _coerce(v, hints[k], _flag(k))
                except ConfigError:
                    pass
            elif v is None:  # `algo_options:` with nothing after it, as parse_args reads it
                v = {}
            if k == "model" and isinstance(v, str) and v.strip().lower() == "auto":
                v = "auto"
            out[k] = v
        return canonical_identity(json.loads(json.dumps(out, default=str)))

    then, now = read(layer), read(final)
    changed = [k for k in names if k != "seed" and then[k] != now[k]]
    return [k for k in changed if OPTION_OWNERS.get(k) not in changed and not (k in extra and "algo" in changed)]


def _reference_row(reference: Dict[str, Any]) -> str:
    """' (ROW)' naming a reference in a note (its row, else table, else paper), or ''."""
    row = next((str(reference[k]) for k in ("row", "table", "paper") if reference.get(k)), "")
    return f" ({row})" if row else ""


def _options_for_replaced_algorithm(file_values: Dict[str, Any], flag_algo: Optional[str],
                                    algo_cls) -> Tuple[Dict[str, Any], List[str]]:
    """A file's ``algo_options`` were written for the file's ``algo``. When ``--algo`` names
    another one, the options it also has carry over (the pMixFed files' ``finetune_epochs`` serves
    every method of their table) unless the two mean different things (:data:`METHOD_SPECIFIC`),
    and the others are dropped, not refused: a file's settings cannot be removed from the command
    line. Returns the file's values with those options, and what to say of them in the rank-0
    note (:func:`parse_args`): an option of the same name may still mean another thing (FedProx's
    mu is not pMixFed's). The file's ``reference`` is judged with the other settings, by
    :func:`identity_changes`."""
    from .algorithms import ALGORITHMS

    file_algo, opts = file_values.get("algo"), file_values.get("algo_options")
    if (not flag_algo or not isinstance(file_algo, str) or file_algo not in ALGORITHMS
            or ALGORITHMS.canonical(file_algo) == ALGORITHMS.canonical(flag_algo)):
        return file_values, []
    out = dict(file_values)
    new_name = ALGORITHMS.canonical(flag_algo)
    said = []
    if isinstance(opts, dict) and opts:
        names, old_cls = option_names(algo_cls.Options), ALGORITHMS.get(file_algo).Options
        kept = {k: v for k, v in opts.items() if k in names and _same_meaning(old_cls, algo_cls.Options, k)}
        other = {k: v for k, v in opts.items() if k in names and k not in kept}
        dropped = sorted(str(k) for k in opts if k not in names)
        parts = []
        if kept:
            parts.append(f"{', '.join(f'{k}={v}' for k, v in kept.items())} carried over to {new_name} (an option "
                         f"of the same name; {', '.join(_flag(k) for k in kept)} sets it)")
        if other:
            parts.append(f"{', '.join(f'{k}={v}' for k, v in other.items())} not carried over ({new_name}'s option "
                         f"of that name means another thing; its default applies; "
                         f"{', '.join(_flag(k) for k in other)} sets it)")
        if dropped:
            parts.append(f"{', '.join(dropped)} dropped ({new_name} has no such option)")
        said.append(f"of its algo_options, {'; '.join(parts)}")
        out["algo_options"] = kept
    return out, said


def _channel_options_for_no_channel(file_values: Dict[str, Any], flag_channel: Optional[str]
                                    ) -> Tuple[Dict[str, Any], List[str]]:
    """A file's ``channel_options`` parametrise the file's channel model. ``--channel none`` over a
    file with a model runs the ideal-link twin of that setting (the ablation a channel study
    needs), so the options go with the model, said in the rank-0 note, rather than refusing a run
    whose options cannot be removed from the command line. Options given with ``--channel-opt``,
    or written beside ``channel: none`` in the file itself, are still refused by validate()."""
    file_channel, opts = file_values.get("channel", RunConfig.channel), file_values.get("channel_options")
    if (flag_channel is None or flag_channel.strip().lower() != "none" or not isinstance(opts, dict) or not opts
            or not isinstance(file_channel, str) or file_channel.strip().lower() == "none"):
        return file_values, []
    return ({**file_values, "channel_options": {}},
            [f"its channel_options ({', '.join(f'{k}={v}' for k, v in opts.items())}) parametrise its channel "
             f"{file_channel} and are dropped with it"])


def _reference_for_flags(file_values: Dict[str, Any], cfg: "RunConfig") -> List[str]:
    """Drop from ``cfg`` a reference its config file wrote when the command line changed the
    file's identity settings (:func:`identity_changes`): the report would hold the run against
    the row of another setting. Returns what to say of it in the rank-0 note; the algorithm's
    part in the words of ``--algo``'s note ("is pmixfed's")."""
    reference = file_values.get("reference")
    if not (isinstance(reference, dict) and reference and cfg.reference):
        return []
    changed = identity_changes(file_values, cfg.to_dict())
    if not changed:
        return []
    cfg.reference = {}
    parts = [f"is {_file_algo(file_values)}'s"] if "algo" in changed else []
    others = [k for k in changed if k != "algo"]
    if others:
        parts.append(f"describes the file's {', '.join(others)}")
    return [f"its reference{_reference_row(reference)} {', '.join(parts)} and is dropped"]


def _file_algo(file_values: Dict[str, Any]) -> str:
    """The algorithm a config file runs, as the registry names it (RunConfig's default if unset)."""
    from .algorithms import ALGORITHMS

    algo = file_values.get("algo", RunConfig.algo)
    return ALGORITHMS.canonical(algo) if algo in ALGORITHMS else str(algo)


def parse_args(argv: Optional[List[str]] = None):
    """Parse ``argv`` into (RunConfig, algorithm options, data options). Raises ConfigError."""
    from .algorithms import ALGORITHMS, load_algorithm_modules
    from .data import DATASETS, load_dataset_modules
    from .data.partition import check_partition
    from .models import MODELS, check_model_options, load_model_modules
    from .server.channel import ChannelOptions

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--algo")
    pre.add_argument("--dataset")
    pre.add_argument("--model")
    pre.add_argument("--channel")
    known, _ = pre.parse_known_args(argv)
    file_values = load_yaml(known.config) if known.config else {}

    for key in ("algo", "dataset", "model"):
        # YAML reads `algo: null`, `algo: 5`, `algo: [fedavg]` as non-strings, which no registry can look up
        if key in file_values and not isinstance(file_values[key], str):
            raise ConfigError(f"config file {known.config!r}: {key} must be a name (a string), got "
                              f"{file_values[key]!r}; write e.g. `{key}: {getattr(RunConfig, key)}` "
                              f"(python -m fedhpc.launch --help lists the names)")

    load_algorithm_modules(); load_dataset_modules(); load_model_modules()
    algo_name = known.algo or file_values.get("algo", RunConfig.algo)
    data_name = known.dataset or file_values.get("dataset", RunConfig.dataset)
    valid_keys = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(file_values) - valid_keys, key=str)
    if unknown:
        raise ConfigError(_unknown_settings(known.config, unknown, file_values, algo_name, data_name,
                                            known.model or file_values.get("model")))
    algo_cls = ALGORITHMS.get(algo_name)
    data_spec = DATASETS.get(data_name)
    file_written = file_values
    file_values, said = _options_for_replaced_algorithm(file_values, known.algo, algo_cls)
    file_values, said_channel = _channel_options_for_no_channel(file_values, known.channel)
    said += said_channel
    # The run holds the registry's spelling ('Fedprox' -> 'fedprox', the alias 'fl' -> 'fedavg'): its
    # identity, which --resume compares, and the names reports group by must not depend on the typing.
    algo_name, data_name = ALGORITHMS.canonical(algo_name), DATASETS.canonical(data_name)

    parser = argparse.ArgumentParser(
        prog="python -m fedhpc.launch",
        description="Simulate federated learning over MPI / torchrun / srun ranks.",
        epilog=_catalogue(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of settings (flags override it)")
    _add_dataclass_flags(parser.add_argument_group("run"), RunConfig)
    parser.add_argument("--data-opt", action="append", metavar="KEY=VALUE", help="dataset option (repeatable)")
    parser.add_argument("--model-opt", action="append", metavar="KEY=VALUE", help="model option (repeatable)")
    parser.add_argument("--channel-opt", action="append", metavar="KEY=VALUE",
                        help="channel parameter, e.g. p_up_dbm=30 (repeatable; see fedhpc/server/channel.py)")
    algo_flags = []
    if algo_cls.Options is not None:
        algo_flags = _add_dataclass_flags(parser.add_argument_group(f"{algo_name} options"), algo_cls.Options)
    args = vars(parser.parse_args(argv))

    values = dict(file_values)
    for k in valid_keys:
        if k in args:
            values[k] = args[k]
    values["algo"], values["dataset"] = algo_name, data_name
    for k in ("algo_options", "data_options", "model_options", "channel_options", "reference"):
        v = values.get(k) or {}
        if not isinstance(v, dict):
            raise ConfigError(f"{k} must be a mapping of option: value, got {v!r}")
        values[k] = dict(v)
    values["algo_options"].update({k: args[k] for k in algo_flags if k in args})
    values["data_options"].update(_parse_kv(args.get("data_opt"), "--data-opt"))
    values["model_options"].update(_parse_kv(args.get("model_opt"), "--model-opt"))
    values["channel_options"].update(_parse_kv(args.get("channel_opt"), "--channel-opt"))

    hints = get_type_hints(RunConfig)
    cfg = RunConfig(**{k: (_coerce(v, hints[k], _flag(k)) if hints[k] in (int, float, str, bool) else v)
                       for k, v in values.items()})
    cfg.validate()
    # What can be refused without the data is refused here, before a dataset is loaded (a sweep
    # validates its points through this function); what needs the labels is checked when built.
    check_partition(cfg.partition)
    if cfg.model.strip().lower() == "auto":
        cfg.model = "auto"
    else:
        MODELS.get(cfg.model)
        cfg.model = MODELS.canonical(cfg.model)
        check_model_options(cfg.model, cfg.model_options)
    algo_opts = build_options(algo_cls.Options, cfg.algo_options, f"algorithm {algo_name!r}")
    data_opts = build_options(data_spec.options, cfg.data_options, f"dataset {data_name!r}")
    if cfg.channel != "none":  # the engine builds them again; checked here so a sweep's bad point stops before any runs
        build_options(ChannelOptions, cfg.channel_options, f"channel {cfg.channel!r}")
    # The file's reference is the paper's number for the file's setting: flags that change it
    # (--algo, --partition, --channel, an option...; not --seed, nor --rounds but for pMixFed) drop it, said once.
    said += _reference_for_flags(file_written, cfg)
    if said and launcher_rank() == 0:
        if known.algo and _file_algo(file_written) != algo_name:
            head = f"--algo {algo_name} replaces the file's algo {_file_algo(file_written)}"
        else:
            head = f"the command line changes settings of {known.config}"
        print(f"note: {head}; {'; '.join(said)}", file=sys.stderr, flush=True)
    return cfg, algo_opts, data_opts
