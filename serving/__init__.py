"""tierserve: serving."""
