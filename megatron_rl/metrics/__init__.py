"""Metrics: mismatch statistics (pure, reducible sums) and the logging sink."""
