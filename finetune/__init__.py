"""finetune."""
