"""Tokenizers (tokenizer.json and GGUF vocabularies) and chat templates."""
