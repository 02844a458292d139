"""A plain Hugging Face Trainer script, nothing of nodectl in it but where its checkpoints go
($NODECTL_OUTPUT_DIR): a tiny random Llama, checkpoints every 5 steps, resumed from the newest one when there is
one, as a user's script does. `--hold-at N` makes the first attempt wait after step N until it is stopped."""
import argparse
import os
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--hold-at", type=int, default=0)
options = parser.parse_args()


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        ids = torch.arange(16) * (i % 7 + 1) % 64
        return {"input_ids": ids, "labels": ids}


class Hold(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        print(f"at step {state.global_step}", flush=True)
        if options.hold_at and state.global_step > options.hold_at and os.environ.get("NODECTL_ATTEMPT") == "0":
            while True:
                time.sleep(1)


torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
out = os.environ.get("NODECTL_OUTPUT_DIR", "out")
args = TrainingArguments(output_dir=out, max_steps=options.steps, save_steps=5, per_device_train_batch_size=2,
                         logging_steps=1, report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
last = get_last_checkpoint(out) if os.path.isdir(out) else None
print(f"resume from: {os.path.basename(last) if last else 'none'}", flush=True)
trainer = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Hold()])
trainer.train(resume_from_checkpoint=last)
print(f"finished at global step {trainer.state.global_step}", flush=True)
if torch.distributed.is_initialized():   # gloo aborts a process that leaves with its group still up
    torch.distributed.destroy_process_group()
# and even then, now and again, a gloo thread aborts the interpreter's teardown (SIGABRT, "terminate called
# without an active exception") after everything is done: torch's, not the resume's under test
sys.stdout.flush()
os._exit(0)
