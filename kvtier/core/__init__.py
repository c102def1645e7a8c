"""Contracts and machinery. Imports nothing from ``kvtier.backends`` or ``kvtier.plugins``."""
