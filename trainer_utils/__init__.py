"""Training machinery shared by the pretrain and SFT scripts: one loop, backends, checkpoints, metrics."""
