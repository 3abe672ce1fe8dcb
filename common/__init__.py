"""Torch-free foundations every layer may import: typed errors, typed configuration, file and naming helpers."""
