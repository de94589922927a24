"""aclnnSyncBatchNormGatherStats: being written (SyncBatchNorm family, part 2)."""
