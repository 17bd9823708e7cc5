"""What training writes for people to read: loss curves, held-out evaluation tables, the
quantization report."""
