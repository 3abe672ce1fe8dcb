"""`python -m model` prints the preset table (shapes and parameter counts) shown in the README."""
from .config import preset_table

print(preset_table())
