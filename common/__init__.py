"""Foundations every layer may import: typed errors, typed configuration, file and naming helpers (torch-free),
and the device and precision policy (common/device.py, the one module here that imports torch)."""
