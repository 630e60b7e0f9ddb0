"""What is checkpointed: the operators of any MoE model, the MoE structure, optimizer state rules, router counts,
the run identity, and the coverage check of what the slot format can hold."""
