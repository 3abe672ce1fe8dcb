"""Measuring a model: benchmark items scored by log-likelihood or generation (scoring), samples and probes for
watching training (probes), decoding sweeps (sweep), and the tool loop with its tool-call accuracy (tool_use).
Uses model/ and common/; the trainer and eval_model.py use it."""
