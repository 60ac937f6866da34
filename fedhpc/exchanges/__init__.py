"""Collective exchanges an algorithm takes part in before or during a round.

One module per exchange, e.g. ``mean_data`` (MAFL's mean data, FedMix paper Alg. 1).
Each is called on every rank at once through ``algo.comm`` and returns the same
result on every rank, whatever the number of ranks. The engine knows none of them.
"""
