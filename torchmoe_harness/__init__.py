"""What sits on top of the `torchmoe_ckpt` library (which never imports it): a small deterministic MoE training
harness (torchrun + gloo, FSDP2/HSDP, and pipeline stages) used as the oracle that every recovery test and the
`selftest` command compare against, the benchmark suite (`bench`, `baselines/`, `format_compare`), the ETTR
simulator (`ettr`), and the `torchmoe-ckpt` subcommands for them (`commands`, registered as entry points).
The harness model's expert layout matches TorchTitan 0.3.0's GroupedExperts so operator discovery works on both."""
