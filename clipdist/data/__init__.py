"""WebDataset streams, built-in real datasets, and the shard writer."""
