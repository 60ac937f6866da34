"""Reports of finished runs: tables over seeds beside the papers' numbers, plots, TensorBoard hparams.

``python -m fedhpc.report RUNS_DIR`` (cli.py); ``write_hparams`` (tensorboard.py) is called by the
engine at the end of a run.
"""

from .build import build_report
from .tensorboard import hparams_of, write_hparams

__all__ = ["build_report", "hparams_of", "write_hparams"]
