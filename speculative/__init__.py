"""tierserve: speculative."""
