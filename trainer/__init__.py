"""The built-in FSDP2 + LoRA trainer (`python -m trainer`)."""
