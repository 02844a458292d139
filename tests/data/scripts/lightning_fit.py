"""A plain Lightning script, nothing of nodectl in it: a tiny regression model, a checkpoint every 4 steps
(ModelCheckpoint), a validation pass every 4 steps, 10 steps. `--save-sleep S` makes each checkpoint take S seconds
longer (a slow disk), `--val-sleep S` each validation pass."""
import argparse
import os
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

parser = argparse.ArgumentParser()
parser.add_argument("--save-sleep", type=float, default=0.0)
parser.add_argument("--val-sleep", type=float, default=0.0)
options = parser.parse_args()


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def on_validation_epoch_end(self):
        time.sleep(options.val_sleep)

    def on_save_checkpoint(self, checkpoint):
        time.sleep(options.save_sleep)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def rows(n):
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


out = os.environ.get("NODECTL_OUTPUT_DIR", "out")
trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, val_check_interval=4, limit_val_batches=2,
                    num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=4, save_top_k=-1)])
trainer.fit(Model(), rows(64), rows(8))
print(f"finished at global step {trainer.global_step}", flush=True)
