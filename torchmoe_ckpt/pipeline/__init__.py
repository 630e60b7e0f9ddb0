"""Pipeline parallelism: stage-boundary logs and localized recovery of one stage."""
