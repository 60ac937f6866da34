"""A run's TensorBoard event files: the tag each metric is logged under, and the hyperparameters and
final metrics for the HParams tab.

Tags are grouped, one TensorBoard section per group (:func:`tensorboard_tag`): ``test/accuracy``,
``train/loss``, ``local/accuracy_mean``, ``comm/bytes_up_parameters``, ``channel/uplink_outages``,
``time/round_seconds``...; metrics.jsonl keeps the metric names themselves (the report reads them).

The HParams session goes into the run's own event folder (beside its per-round scalars), so that
``tensorboard --logdir SWEEP/runs`` shows one HParams session per run. Its metrics are the final
round's, declared by their per-round tags: the HParams tab reads each one's last value, the final
one, so they are not written a second time.

The session's hyperparameters are the run's settings as it resolved them (run.json's ``config``: the
model built rather than ``auto``, every option with its default filled in, so a FedProx run at the
default ``mu`` has an ``algo_options.mu``), less those that say how or where it ran
(:data:`NOT_HPARAMS`: data_dir, threads, collective_timeout, client_state_budget_mb, eval_batch_size...).
The tab takes its columns from ONE experiment summary (the first it finds), and each run writes one:
a run that is a point of a sweep declares every column of the sweep's points (``hparams`` in its
sweep.json, written by the sweep: :func:`sweep_hparam_types`), so whichever run the tab picks, every
swept setting is a column.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

from .runs import RUN_LOCAL, flatten, sweep_point

# How or where a run executed, not what it computed: noise in a comparison of runs (the seed stays:
# the tab lists sessions, one per seed).
NOT_HPARAMS = tuple(k for k in RUN_LOCAL if k != "seed") + ("save_client_models",)
#: options that say where a dataset's files are or how they are held, not what is computed
NOT_HPARAM_OPTIONS = ("data_options.store", "data_options.store_dir", "data_options.store_threshold_mb",
                      "data_options.dir")

#: metric name -> tag, for names that are not read by a prefix rule below
_TAGS = {
    "train_loss": "train/loss", "lr": "train/lr", "clients": "train/clients",
    "relative_change": "train/relative_change", "converged": "train/converged",
    "local_eval_clients": "local/eval_clients",
    "reference_device_accuracy": "local/reference_device_accuracy",
    "participation_gap": "cold_start/participation_gap",
    "uplink_outages": "channel/uplink_outages", "downlink_outages": "channel/downlink_outages",
    "comm_seconds": "channel/comm_seconds", "compute_seconds": "channel/compute_seconds",
    "sim_round_seconds": "channel/sim_round_seconds", "sim_seconds_total": "channel/sim_seconds_total",
    "round_seconds": "time/round_seconds", "round_seconds_total": "time/round_seconds_total",
    "eval_seconds": "time/eval_seconds",
    "seeds_uploaded": "server/seeds_uploaded", "seeds_delivered": "server/seeds_delivered",
    "server_samples": "server/samples", "server_train_loss": "server/train_loss",
    "seeds_leaking_raw": "privacy/seeds_leaking_raw",
}

#: (metric name prefix, group/ and what replaces the prefix), first match wins
_PREFIXES = (
    ("local_test_", "local/"),          # local_test_accuracy_mean -> local/accuracy_mean
    ("test_", "test/"),                 # test_accuracy, test_loss, test_accuracy_label<c>
    ("cold_start_", "cold_start/"),     # cold_start_accuracy_mean -> cold_start/accuracy_mean
    ("bytes_", "comm/bytes_"),          # bytes_up_parameters -> comm/bytes_up_parameters
    ("sample_privacy_", "privacy/sample_privacy_"),
)


def tensorboard_tag(name: str) -> str:
    """The TensorBoard tag of metrics.jsonl's metric ``name``, ``group/rest``:

    * ``test/``: the global model on the global test set (``test_accuracy`` -> ``test/accuracy``,
      ``test_loss``, ``test_accuracy_label<c>``);
    * ``train/``: ``train_loss`` -> ``train/loss``, ``lr``, ``clients``, ``relative_change``;
    * ``local/``: the clients' models on their own splits (``local_test_accuracy_mean`` ->
      ``local/accuracy_mean``, ``local_eval_clients``, ``reference_device_accuracy``);
    * ``cold_start/``: clients held out of training (``cold_start_*``, ``participation_gap``);
    * ``comm/``: traffic (``bytes_up``, ``bytes_down_total``, per kind ``bytes_up_parameters``...);
    * ``channel/``: the wireless channel (outages, comm / compute / simulated seconds);
    * ``time/``: wall clock (``round_seconds``, ``round_seconds_total``, ``eval_seconds``);
    * ``server/``: server-side data of the FLD family and one-shot methods (seeds, samples, its loss);
    * ``privacy/``: sample privacy and raw-leak measures;
    * ``algo/``: any other metric, an algorithm's own (``mu_aggregation`` -> ``algo/mu_aggregation``).
    """
    if name in _TAGS:
        return _TAGS[name]
    for prefix, group in _PREFIXES:
        if name.startswith(prefix) and len(name) > len(prefix):
            return group + name[len(prefix):]
    return f"algo/{name}"


def hparams_of(config: Dict[str, Any]) -> Dict[str, Any]:
    """The config as HParams values: nested options flattened to "algo_options.lam"; numbers and
    strings kept; booleans as "true"/"false" (the plugin would turn them into 1.0/0.0); None,
    lists and other values left out (the plugin has no type for them). Settings of how or where the
    run executed are left out (:data:`NOT_HPARAMS`, :data:`NOT_HPARAM_OPTIONS`), and the channel's
    options of a run without a channel."""
    out: Dict[str, Any] = {}
    no_channel = str(config.get("channel", "none")).strip().lower() == "none"
    for k, v in flatten({k: v for k, v in config.items() if k not in NOT_HPARAMS}).items():
        if k in NOT_HPARAM_OPTIONS or (no_channel and k.startswith("channel_options.")):
            continue
        if isinstance(v, bool):
            out[k] = "true" if v else "false"
        elif isinstance(v, (int, float, str)):
            out[k] = v
    return out


def hparam_types(configs: Iterable[Dict[str, Any]]) -> Dict[str, str]:
    """Every HParams column of ``configs`` (resolved configurations, options with their defaults):
    ``{name: "number" | "string"}``, in order of first appearance (a name that is a number in one
    and a string in another is a string)."""
    out: Dict[str, str] = {}
    for config in configs:
        for k, v in hparams_of(config).items():
            kind = "string" if isinstance(v, str) else "number"
            out[k] = "string" if out.get(k, kind) == "string" or kind == "string" else "number"
    return out


def sweep_hparam_types(configs: Iterable[Any]) -> Dict[str, str]:
    """:func:`hparam_types` of a sweep's points (their validated RunConfigs), each read with every
    option's default filled in, as the run will record it (a model left at ``auto`` has its options
    as given until the run resolves it)."""
    from ..config.identity import canonical_identity

    return hparam_types(canonical_identity(c.to_dict()) for c in configs)


def sweep_hparams(run_dir: str) -> Optional[Dict[str, str]]:
    """The HParams columns of the sweep whose point ``run_dir`` is (``SWEEP/runs/<id>``, listed in
    ``SWEEP/sweep.json``), or None where it is none or the manifest predates the columns."""
    point = sweep_point(run_dir)
    declared = (point or {}).get("sweep", {}).get("hparams")
    if not isinstance(declared, dict):
        return None
    return {str(k): ("string" if v == "string" else "number") for k, v in declared.items()}


def write_hparams(log_dir: str, config: Dict[str, Any], final_metrics: Dict[str, Any],
                  writer: Optional[Any] = None, scalars_logged: bool = False,
                  declared: Optional[Dict[str, str]] = None) -> Dict[str, float]:
    """Write the HParams session of one run into ``log_dir``; returns the metrics declared, by tag.

    ``final_metrics``: the last round's metrics (numeric values only are kept; ``round`` gives
    the step). ``writer``: an open SummaryWriter on ``log_dir`` to reuse (the engine's), else
    one is opened and closed here. ``scalars_logged``: the folder's per-round scalars already hold
    these values under their tags at the final step (the engine's run), so the session only
    declares them; otherwise they are written there once. ``declared``: further columns of the
    experiment ({name: "number" | "string"}: the sweep's, :func:`sweep_hparams`), which the
    session holds no value of where the run has no such setting (FedAvg's ``algo_options.mu``).
    """
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    step = int(final_metrics.get("round", 0) or 0)
    metrics = {tensorboard_tag(k): float(v) for k, v in final_metrics.items()
               if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    own = hparams_of(config)
    _, ssi, sei = hparams(own, metrics)
    # the experiment's columns: the run's own, then the sweep's others (a stand-in value gives the type)
    columns = {k: ("" if kind == "string" else 0.0) for k, kind in (declared or {}).items() if k not in own}
    exp, _, _ = hparams({**own, **columns}, metrics)
    own = writer is None
    w = SummaryWriter(log_dir) if own else writer
    try:
        fw = w.file_writer
        for summary in (exp, ssi, sei):
            fw.add_summary(summary, step)
        if not scalars_logged:
            for tag, v in metrics.items():
                w.add_scalar(tag, v, step)
        w.flush()
    finally:
        if own:
            w.close()
    return metrics
