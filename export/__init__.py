"""A PocketLM checkpoint for other programs: transformers (Llama, Qwen3, GPT-2, Mixtral-style MoE) and PEFT
adapters both ways (convert), and GGUF for llama.cpp and Ollama (gguf). Uses model/ and common/."""
