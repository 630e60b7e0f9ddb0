"""Operations tools: the line a user reads after a recovery, the torchmoe-ckpt command line, inspect/verify."""
