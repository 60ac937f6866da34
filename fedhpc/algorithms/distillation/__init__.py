"""The Mix2FLD paper (Oh et al., 2020): federated distillation and its model-output conversion.

``fd`` (devices exchange per-label average outputs, Eqs. 2-3), ``fld`` (outputs up, a model
down: the server distils on seed samples, Eq. 5), ``mixfld`` (seeds uploaded as mixups,
Eq. 6), ``mix2fld`` (the server inversely mixes them, Eqs. 7-8). Outputs travel through
:mod:`fedhpc.exchanges.label_outputs`, seeds through :mod:`fedhpc.exchanges.seed_samples`, the
channel of Eq. 4 is :mod:`fedhpc.server.channel`.
"""
