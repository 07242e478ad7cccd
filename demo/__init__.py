"""The embedded CPU default's data: the demo task generators, their tokenizer and oracles."""
