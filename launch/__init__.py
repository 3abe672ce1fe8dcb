"""Launchers: Slurm submission via submitit, DeepSpeed configs, multi-node command helpers."""
