"""Measurements taken on a run's data and models, outside training (``privacy``: Mix2FLD's sample privacy and raw-sample audit)."""
