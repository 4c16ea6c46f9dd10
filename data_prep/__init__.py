"""data_prep."""
