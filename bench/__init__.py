"""shoal's benchmark harness: ``python bench/run.py --help``."""
