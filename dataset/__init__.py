"""Data pipeline: cleaning, tokenization cache, pretrain and SFT datasets, bundled demo corpus."""
