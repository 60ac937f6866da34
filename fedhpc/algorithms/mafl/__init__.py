"""The FedMix paper (Yoon et al., ICLR 2021): mean-augmented FL.

``mixing`` (the losses: mixup, NaiveMix Eq. 1, FedMix Eq. 5 with its input-gradient term),
``localmix`` (mixup within a client's data), ``globalmix`` (mixup with other clients' raw
samples: a privacy-violating upper reference), ``naivemix`` (Eq. 1 with the exchanged mean
data), ``fedmix`` (NaiveMix with the loss of Eq. 5). Mean data travel through
:mod:`fedhpc.exchanges.mean_data`.
"""
