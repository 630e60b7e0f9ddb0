"""Operations tools: the status lines a user reads, the torchmoe-ckpt command line, inspect/verify."""
