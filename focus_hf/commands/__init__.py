"""The `focus-hf` sub-commands, one module each; nothing outside this folder imports from it (`cli.py` aside)."""
