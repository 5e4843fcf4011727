"""Lightning's own demo `LightningTransformer` (torch's `nn.Transformer`), as a user would train
it under the framework, and the token pairs it learns from (in memory: nothing downloaded)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer


class DemoTransformer(LightningTransformer):
    """Lightning's demo task as it ships (its SGD, its nll loss), with a small model, no dropout
    (a split activation draws its own mask on each rank, not one process's), and its loss logged
    as the framework's metrics read it."""

    def __init__(
        self, vocab_size: int = 96, ninp: int = 32, nhead: int = 4, nhid: int = 64, layers: int = 2
    ) -> None:
        super().__init__(vocab_size=vocab_size)
        self.model = Transformer(
            vocab_size=vocab_size, ninp=ninp, nhead=nhead, nhid=nhid, nlayers=layers, dropout=0.0
        )

    def prepare_data(self) -> None:
        """Nothing to download: the data module holds the tokens."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss, sync_dist=True)  # the mean over ranks, as one process
        return loss


class TokenPairs(pl.LightningDataModule):
    """(inputs, next tokens) of random token sequences (seed 0), as the demo's WikiText2 gives."""

    def __init__(self, batch_size: int = 8, length: int = 12, vocab: int = 96) -> None:
        super().__init__()
        self.batch_size, self.length, self.vocab = batch_size, length, vocab

    def setup(self, stage=None) -> None:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab, (256, self.length + 1), generator=generator)
        self.train_set = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)
