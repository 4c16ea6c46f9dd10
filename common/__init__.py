"""Generic helpers the whole project shares: file hashing and durable writes, locks, signals, the typed config
loader, the repository root. Nothing here imports any other package of the project, so every layer may use it."""
