"""aclnnBatchNormElemt: being written (SyncBatchNorm family, part 1)."""
