"""The FedAlign paper (Mendieta et al., CVPR 2022) and its study's local-learning baselines.

``local_reg`` (the base: a client loss with a regulariser, the width-sliced passes and draws
they share), ``fedalign`` (Lipschitz-constant alignment of the last block), ``moon`` (model
contrast), ``mixup``, ``stochdepth`` (stochastic depth), ``gradaug`` (sub-network
distillation). Their second-order metrics are :mod:`fedhpc.analysis.hessian`.
"""
