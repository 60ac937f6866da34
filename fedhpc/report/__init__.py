"""Reports of finished runs: tables over seeds beside the papers' numbers, plots, TensorBoard hparams.

``python -m fedhpc.report RUNS_DIR`` (cli.py); ``load_runs(DIR)`` (runs.py): one row per run (settings,
final and best metrics) as a pandas DataFrame or a list of dicts, for a notebook; ``write_hparams``
(tensorboard.py) is called by the engine at the end of a run.
"""

from .build import build_report
from .runs import load_runs
from .tensorboard import hparams_of, tensorboard_tag, write_hparams

__all__ = ["build_report", "hparams_of", "load_runs", "tensorboard_tag", "write_hparams"]
