"""pretrain."""
