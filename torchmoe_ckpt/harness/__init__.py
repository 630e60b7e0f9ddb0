"""A small deterministic MoE training harness (torchrun + gloo, FSDP2/HSDP) used as the oracle that every
recovery test and the `selftest` command compare against. Its expert layout matches TorchTitan 0.3.0's
GroupedExperts so operator discovery works on both."""
