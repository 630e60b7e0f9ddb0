"""Exports of a committed window to other formats: Hugging Face safetensors folders from slot 0, no replay."""
