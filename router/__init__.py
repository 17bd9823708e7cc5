"""tierserve: router."""
