"""A run's hyperparameters and final metrics for TensorBoard's HParams tab.

The summaries go into the run's own event folder (beside its per-round scalars), so that
``tensorboard --logdir SWEEP/runs`` shows one HParams session per run. The final metrics are
written as scalars under ``hparams/<name>`` at the final round, and declared as the session's
metrics: they cannot clash with the per-round ``test_accuracy`` curve of the same folder.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .runs import flatten

# How or where a run executed, not what it computed: noise in a comparison of runs.
NOT_HPARAMS = ("out", "resume", "quiet", "tensorboard", "reference")


def hparams_of(config: Dict[str, Any]) -> Dict[str, Any]:
    """The config as HParams values: nested options flattened to "algo_options.lam"; numbers and
    strings kept; booleans as "true"/"false" (the plugin would turn them into 1.0/0.0); None,
    lists and other values left out (the plugin has no type for them)."""
    out: Dict[str, Any] = {}
    for k, v in flatten({k: v for k, v in config.items() if k not in NOT_HPARAMS}).items():
        if isinstance(v, bool):
            out[k] = "true" if v else "false"
        elif isinstance(v, (int, float, str)):
            out[k] = v
    return out


def write_hparams(log_dir: str, config: Dict[str, Any], final_metrics: Dict[str, Any],
                  writer: Optional[Any] = None) -> Dict[str, float]:
    """Write the HParams session of one run into ``log_dir``; returns the metrics written.

    ``final_metrics``: the last round's metrics (numeric values only are kept; ``round`` gives
    the step). ``writer``: an open SummaryWriter on ``log_dir`` to reuse (the engine's), else
    one is opened and closed here.
    """
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    step = int(final_metrics.get("round", 0) or 0)
    metrics = {f"hparams/{k}": float(v) for k, v in final_metrics.items()
               if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    exp, ssi, sei = hparams(hparams_of(config), metrics)
    own = writer is None
    w = SummaryWriter(log_dir) if own else writer
    try:
        fw = w.file_writer
        for summary in (exp, ssi, sei):
            fw.add_summary(summary, step)
        for tag, v in metrics.items():
            w.add_scalar(tag, v, step)
        w.flush()
    finally:
        if own:
            w.close()
    return metrics
