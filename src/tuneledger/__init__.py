"""tuneledger: measure, then fine-tune ~7B chat models with LoRA/QLoRA on 2-8 GPUs."""

__version__ = "0.1.0"
