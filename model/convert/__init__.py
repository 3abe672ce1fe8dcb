"""`python -m model.convert`, the export command's name since the first release: it runs export/convert.py (the
exports live in export/, above the network; this package holds only the command's entry point)."""
