"""Character-level language model for Shakespeare (FedMix, TFF/LEAF)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from . import register_model


class CharLSTM(nn.Module):
    """Embedding -> stacked LSTM -> linear, predicting the next character at every position.

    FedMix, App. B (Shakespeare): "We used 2-layer LSTM, both with hidden
    dimension of 256. The recurrent network is followed by an embedding layer
    [i.e. it takes the embeddings as input]. The output of LSTM is passed to a
    fully-connected layer, with softmax output of one node per character."
    The embedding size is not given; 8 as in the TFF / LEAF Shakespeare model.
    FedMix mixes on the embeddings ("Mixup on the embedding layer"), hence the
    split ``forward(ids) == forward_embedded(embed(ids))``.

    * input: ``(B, T)`` int64 character ids in ``[0, num_classes)``;
    * output: logits ``(B, T, V)``, ``V = num_classes`` (the vocabulary size:
      FedMix reports 84 characters, LEAF uses 80, TFF 86 + 4 special ids);
      position t predicts character t+1. No softmax.
    * each LSTM layer is its own ``nn.LSTM`` module so that ``layers()`` lists
      ``embedding, lstm.0, lstm.1, head`` for the layer-wise algorithms.

    ``input_shape`` is the sequence shape, e.g. ``(80,)``; the model accepts any
    sequence length.
    """

    def __init__(self, input_shape, num_classes: int, embed_dim: int = 8, hidden: int = 256, num_layers: int = 2):
        super().__init__()
        if num_classes < 2 or num_layers < 1:
            raise ConfigError("lstm_char needs num_classes (vocabulary size) >= 2 and num_layers >= 1")
        self.input_shape = tuple(int(s) for s in input_shape)
        self.vocab_size = int(num_classes)
        self.embedding = nn.Embedding(self.vocab_size, embed_dim)
        self.lstm = nn.ModuleList(
            nn.LSTM(embed_dim if i == 0 else hidden, hidden, batch_first=True) for i in range(num_layers)
        )
        self.head = nn.Linear(hidden, self.vocab_size)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids -> ``(B, T, E)`` embeddings (the mixable representation)."""
        return self.embedding(ids)

    def forward_embedded(self, emb: torch.Tensor) -> torch.Tensor:
        """``(B, T, E)`` embeddings (possibly mixed) -> ``(B, T, V)`` logits."""
        h = emb
        for layer in self.lstm:
            h, _ = layer(h)
        return self.head(h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.forward_embedded(self.embed(ids))

    def layers(self):
        return [("embedding", self.embedding)] + [(f"lstm.{i}", m) for i, m in enumerate(self.lstm)] + [
            ("head", self.head)
        ]


@register_model("lstm_char")
def lstm_char(input_shape, num_classes, embed_dim: int = 8, hidden: int = 256, num_layers: int = 2):
    return CharLSTM(input_shape, num_classes, embed_dim, hidden, num_layers)
