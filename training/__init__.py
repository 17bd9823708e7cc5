"""tierserve: training."""
