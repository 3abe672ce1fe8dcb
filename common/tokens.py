"""Conventions of text and tokens shared by data (dataset/), models (model/), serving and training, which never
import each other."""

# The roles of a conversation's turns (MiniMind's and OpenAI's names; "tool" returns a tool call's result).
CHAT_ROLES = ("system", "user", "assistant", "tool")

# The target id losses skip: positions that are not trained on (prompts, padding). PyTorch's cross_entropy default.
IGNORE_INDEX = -100
